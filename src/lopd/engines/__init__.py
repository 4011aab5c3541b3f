"""Rollout engines other than Hugging Face `generate` (`lopd.rollout.sample`).

`lopd.engines.vllm`: a vLLM server (started here or pointed to by URL) sampling the policy through its
OpenAI-compatible completions endpoint, with LoRA / full-weight sync and a check that it samples the
current policy. The client needs only the standard library and torch; vLLM itself runs in the server's
own interpreter (`scripts/setup_vllm_venv.sh` builds `.venv-vllm`), so nothing here imports `vllm`.
"""
