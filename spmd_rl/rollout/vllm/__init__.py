"""The colocated vLLM engine, everything pinned to one vLLM version in one folder: the engine
(engine), its outputs as Completions (outputs), sleep and wake-up (sleep), the model inside the
engine (model_inspection), and the checks of rollout.engine_kwargs (kwargs). vLLM is imported only
when a vLLM engine is built."""
