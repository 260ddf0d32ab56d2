"""Writes corpus.txt, the text charlm trains on: the Gettysburg Address (public domain) followed by a
ship's log generated from a small grammar (written for this example, public domain). Seeded: rerunning it
rewrites the same file. `python make_text.py`"""

from __future__ import annotations

import random
from pathlib import Path

GETTYSBURG = """\
Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in
Liberty, and dedicated to the proposition that all men are created equal.

Now we are engaged in a great civil war, testing whether that nation, or any nation so conceived and so
dedicated, can long endure. We are met on a great battle-field of that war. We have come to dedicate a
portion of that field, as a final resting place for those who here gave their lives that that nation might
live. It is altogether fitting and proper that we should do this.

But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- this ground.
The brave men, living and dead, who struggled here, have consecrated it, far above our poor power to add or
detract. The world will little note, nor long remember what we say here, but it can never forget what they
did here. It is for us the living, rather, to be dedicated here to the unfinished work which they who fought
here have thus far so nobly advanced. It is rather for us to be here dedicated to the great task remaining
before us -- that from these honored dead we take increased devotion to that cause for which they gave the
last full measure of devotion -- that we here highly resolve that these dead shall not have died in vain --
that this nation, under God, shall have a new birth of freedom -- and that government of the people, by the
people, for the people, shall not perish from the earth.
"""

WINDS = ["north", "north-east", "east", "south-east", "south", "south-west", "west", "north-west"]
STRENGTH = ["light airs", "a gentle breeze", "a fresh breeze", "a strong wind", "a moderate gale", "a calm"]
SKY = ["clear skies", "low cloud", "a grey overcast", "passing squalls", "thick fog", "fine weather"]
SEA = ["a long swell", "a short, steep sea", "smooth water", "a confused sea", "a heavy swell"]
WORK = [
    "set the topsails",
    "took in a reef",
    "mended the mainsail",
    "pumped the bilges",
    "scrubbed the decks",
    "sounded the well",
    "shifted the cargo",
    "doubled the lookout",
    "hove the log",
    "took the noon sight",
]
SEEN = [
    "a whale to leeward",
    "a sail on the horizon",
    "a flock of terns",
    "driftwood and weed",
    "the loom of the land",
    "a school of porpoises",
    "nothing all day",
]
CREW = ["the mate", "the cook", "the boatswain", "young Hale", "the carpenter", "old Marsh"]
MOODS = ["in good spirits", "weary", "cheerful", "quiet", "restless", "hopeful of a fair passage"]


def _sentence_case(words: str) -> str:
    return words[0].upper() + words[1:]


def entry(rng: random.Random, day: int) -> str:
    lat = f"{rng.randint(10, 55)} deg {rng.randint(0, 59):02d} min {rng.choice('NS')}"
    lon = f"{rng.randint(5, 70)} deg {rng.randint(0, 59):02d} min W"
    lines = [
        f"Day {day}. Wind {rng.choice(WINDS)}, {rng.choice(STRENGTH)}, with {rng.choice(SKY)} and "
        f"{rng.choice(SEA)}.",
        f"At noon by observation {lat}, {lon}. Ran {rng.randint(40, 210)} miles since yesterday.",
        f"The watch {rng.choice(WORK)} and {rng.choice(WORK)}. Sighted {rng.choice(SEEN)}.",
        f"{_sentence_case(rng.choice(CREW))} reports the men {rng.choice(MOODS)}.",
    ]
    if rng.random() < 0.3:
        lines.append(f"Barometer {rng.choice(['rising', 'falling', 'steady'])}; {rng.choice(WORK)} at dusk.")
    return " ".join(lines)


def main() -> None:
    rng = random.Random(1863)
    entries = [entry(rng, day) for day in range(1, 701)]
    text = GETTYSBURG + "\n" + "\n\n".join(entries) + "\n"
    Path(__file__).with_name("corpus.txt").write_text(text)
    print(f"corpus.txt: {len(text)} characters")


if __name__ == "__main__":
    main()
