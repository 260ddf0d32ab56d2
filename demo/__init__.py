"""The local demo: the real agent and trainer against an embedded AWS (moto) and a simulated IMDS."""
