"""The defaults of the options that change output bytes, apart from the plan's types so that the API's signatures
(and ``resumerge status``, which imports the API) name them without importing the planner."""

DEFAULT_SHARD_SIZE = 1_000_000_000
DEFAULT_SEED = 0
# --gguf-type: how a GGUF output's matrices are stored (resumerge.merge.plan.gguftypes.MIXES: the type of each tensor as
# llama-quantize picks it for the mix), the exact ones first
GGUF_TYPES = ("f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "q6_k", "q5_k_m", "q5_k_s", "q4_k_m", "q4_k_s",
              "iq4_nl", "iq4_xs", "q3_k_l", "q3_k_m", "iq3_m", "iq3_s", "q3_k_s", "iq3_xs", "iq3_xxs", "q2_k", "q2_k_s",
              "iq2_m", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_m", "iq1_s", "mxfp4_moe", "tq2_0", "tq1_0")
