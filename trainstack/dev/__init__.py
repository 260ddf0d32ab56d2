"""`trainstack dev`: a GPU dev box in the stack's VPC with a workspace that outlives it."""
