"""The defaults of the options that change output bytes, apart from the plan's types so that the API's signatures
(and ``resumerge status``, which imports the API) name them without importing the planner."""

DEFAULT_SHARD_SIZE = 1_000_000_000
DEFAULT_SEED = 0
