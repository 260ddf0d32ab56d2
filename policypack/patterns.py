"""IAM Resource patterns judged against the shape of an ARN: does `*` or `?` reach resources nobody named?

A Resource pattern (`*`: any run of characters, colons included; `?`: any one character) is compared with
an ARN *shape*: literal characters, ONE (one character other than ":") and ANY (zero or more of them).
`matches_shape` answers whether at least one ARN of that shape matches the pattern, by a search over
(pattern position, shape element) pairs: exact, whatever way the wildcards are spelled.
"""

from __future__ import annotations

import re

ONE, ANY = "one", "any"
Shape = tuple[str, ...]


def arn_shape(service: str, resource_prefix: str, *, regional: bool = True) -> Shape:
    """arn:<partition>:<service>:<region>:<account>:<resource_prefix><name>, as shape elements.

    `regional=False` for global services (IAM), whose ARNs have an empty region: `arn:aws:iam::<acct>:`.
    """
    region: Shape = (ANY,) if regional else ()
    return (*"arn:", ONE, ANY, *f":{service}:", *region, ":", ANY, ":", *resource_prefix, ONE, ANY)


KEY_ARN = arn_shape("kms", "key/")
ROLE_ARN = arn_shape("iam", "role/", regional=False)
USER_ARN = arn_shape("iam", "user/", regional=False)
POLICY_ARN = arn_shape("iam", "policy/", regional=False)
LAUNCH_TEMPLATE_ARN = arn_shape("ec2", "launch-template/")
FUNCTION_ARN = arn_shape("lambda", "function:")
PARAMETER_ARN = arn_shape("ssm", "parameter/")
SECRET_ARN = arn_shape("secretsmanager", "secret:")
# S3 ARNs have neither region nor account: arn:aws:s3:::<bucket>/<key>.
OBJECT_ARN: Shape = (*"arn:", ONE, ANY, *":s3:::", ONE, ANY, "/", ANY)


def has_wildcard(pattern: str) -> bool:
    return "*" in pattern or "?" in pattern


def matches_shape(pattern: str, shape: Shape) -> bool:
    """Whether an IAM Resource pattern matches at least one string of `shape`. Compared
    case-insensitively: stricter than IAM, which compares ARNs case-sensitively."""
    pattern = pattern.strip().lower()
    end = len(shape)

    def closure(element: int) -> set[int]:
        # An ANY element may match nothing: the elements after it are reachable without a character.
        reached = {element}
        while element < end and shape[element] == ANY:
            element += 1
            reached.add(element)
        return reached

    def consume(element: int, char: str | None) -> set[int]:
        """Elements reached by matching one character: `char`, or any the shape allows here when None."""
        if element == end:
            return set()
        expected = shape[element]
        if expected in (ONE, ANY):
            if char == ":":
                return set()
            return closure(element + 1) if expected == ONE else closure(element)
        return closure(element + 1) if char in (None, expected) else set()

    seen = {(0, element) for element in closure(0)}
    frontier = list(seen)
    while frontier:
        position, element = frontier.pop()
        if position == len(pattern):
            if element == end:
                return True
            continue
        symbol = pattern[position]
        following: set[tuple[int, int]] = set()
        if symbol == "*":
            following.add((position + 1, element))
            following.update((position, after) for after in consume(element, None))
        else:
            char = None if symbol == "?" else symbol
            following.update((position + 1, after) for after in consume(element, char))
        for state in following - seen:
            seen.add(state)
            frontier.append(state)
    return False


def literal_prefix(pattern: str) -> str:
    """The pattern up to its first wildcard: what it pins down exactly."""
    pattern = pattern.strip()
    cut = min((i for i in (pattern.find("*"), pattern.find("?")) if i >= 0), default=len(pattern))
    return pattern[:cut]


# What "names the container" means for resources whose names legitimately end in a wildcard: the bucket of
# an object (arn:aws:s3:::<bucket>/...), a stack's own path of SSM parameters or secrets, two levels deep
# (parameter/<root>/<stack>/..., secret:<root>/<stack>/...: `parameter/trainstack/*` is every stack's), or a
# secret's name with AWS's random six-character suffix left open.
_NAMED_CONTAINER = {
    OBJECT_ARN: re.compile(r"^arn:[^:*?]+:s3:::[^/*?]+/", re.IGNORECASE),
    PARAMETER_ARN: re.compile(r"^arn:[^:*?]+:ssm:[^:*?]+:\d{12}:parameter/[^/*?]+/[^/*?]+/", re.IGNORECASE),
    SECRET_ARN: re.compile(
        r"^arn:[^:*?]+:secretsmanager:[^:*?]+:\d{12}:secret:[^/*?]+/[^/*?]+/", re.IGNORECASE
    ),
}
_SECRET_WITH_SUFFIX = re.compile(
    r"^arn:[^:*?]+:secretsmanager:[^:*?]+:\d{12}:secret:[^*?]+-\?{6}$", re.IGNORECASE
)


def reaches_unnamed(pattern: str, shape: Shape) -> bool:
    """True when `pattern` grants resources of `shape` that it does not name.

    For shapes with a container (S3 objects, SSM parameters, secrets) a wildcard after the named container
    is fine (`arn:aws:s3:::bucket/data/*`, `parameter/trainstack/<stack>/*`, never `parameter/trainstack/*`);
    for every other shape (roles, launch templates, keys) any wildcard that can match the shape reaches
    resources nobody named (`*`, `arn:aws:iam::*:role/x`, `...:role/trainstack-*`).
    """
    pattern = pattern.strip()
    if not has_wildcard(pattern) or not matches_shape(pattern, shape):
        return False
    container = _NAMED_CONTAINER.get(shape)
    if container is None:
        return True
    if shape == SECRET_ARN and _SECRET_WITH_SUFFIX.match(pattern):
        return False
    return not container.match(literal_prefix(pattern))
