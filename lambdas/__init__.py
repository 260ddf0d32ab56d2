"""The stack's Lambda functions, one folder each (infra/ deploys them): `scheduler` raises each pool to what
its waiting jobs need; `capacity_fallback` keeps the cost cap from outside and falls back to on-demand when
spot capacity stays away. Each is packaged as its handler.py plus trainstack_job's standard-library modules
(infra/capacity.py `function_code`)."""
