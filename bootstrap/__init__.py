"""What runs on every instance: the cloud-init template and the instance agent."""
