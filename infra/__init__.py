"""The trainstack Pulumi program: one component per concern; `__main__` only wires them."""
