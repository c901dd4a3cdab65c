"""The benchmark commands of ``litellm-flm``, outside the serving path: the runtime never imports
this package; ``flm_runtime.cli`` loads each command through the entry-point group
``litellm_flm.commands`` (each module's ``COMMAND``) only when it runs.

- ``speed``: ``litellm-flm bench``, decode tokens/s of the plain tag, the DFlash tag's speed-up and
  AL, per prompt context (short, 1k, 4k, the largest the model allows), greedy and sampled;
- ``quick``: ``litellm-flm bench --quick``, TTFT, prefill and decode tokens/s at 1k-8k context;
- ``workload_bench``: ``litellm-flm bench --workloads``, both tags through LiteLLM on the
  requests of ``workloads`` (chat, multi-turn, code edits, RAG, an agent loop, extraction);
- ``peer_workloads``: ``litellm-flm bench --workloads --llama-server PATH`` (or ``--spec-off``),
  any tag against llama-server's plain and n-gram speculation settings (and against itself with
  ``FLM_SPECULATION=0``) on code edits, search/replace edits, predicted outputs,
  fill-in-the-middle, an agent loop and chat;
- ``agreement``: ``litellm-flm agreement``, the 8-token verify path against token-by-token
  decoding, teacher-forced on real text;
- ``calibrate``: ``litellm-flm calibrate``, the speculation policy table the engine reads;
- ``soak``: ``litellm-flm soak``, chat or coding-assistant requests through LiteLLM (stability);
- ``documents``: the prompts and the long public-domain documents (``texts/``) they use;
- ``workloads``: the requests of ``bench --workloads``, built at run time;
- ``engines``, ``report``, ``options``: the engines compared, report files, command-line options;
- ``llama_server``: llama-server's build and process, shared with ``benchmarks/served.py``.

Each command writes Markdown and CSV files (and a PNG plot for ``bench`` and ``bench --workloads``,
with matplotlib) into ``--out``. Speeds are quoted as ratios measured in the same run, never as bare numbers alone.
"""
