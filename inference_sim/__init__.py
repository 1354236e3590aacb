"""A simulated GPU inference pool with an OpenAI-compatible HTTP API.

It stands in for vLLM/TGI or a hosted provider in Sluice's demo, tests and
benchmarks: continuous-batching latency in simulated time (engine.py),
provider RPM/TPM limits (limits.py), heavy-tailed output lengths
(sampling.py), outages and capacity that change at run time (pool.py).
Run it with ``python -m inference_sim --help``. It imports no Django and none
of Sluice's apps; prompt tokens are counted with ``llm_tokens`` exactly as the
gateway estimates them.
"""

from inference_sim.app import create_app
from inference_sim.config import SimConfig, parse_config

__all__ = ["SimConfig", "create_app", "parse_config"]
