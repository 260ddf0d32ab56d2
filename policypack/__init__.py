"""trainstack's security baseline as a Pulumi policy pack that reads any Pulumi AWS stack."""
