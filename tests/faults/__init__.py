"""Fault injection for tests: a proxy in front of the moto server that can cut, blackhole or slow S3."""
