"""The `trainstack` ops CLI: check, watch, feed and stop a trainstack environment without the AWS console."""
