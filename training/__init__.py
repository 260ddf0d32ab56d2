"""The trainstack PyTorch trainer: resumes bit-exactly after any interruption."""
