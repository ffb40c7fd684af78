"""SGLang native-API request and response shapes for the client tests and the fake server.

The first part was reconstructed from SGLang's source (github.com/sgl-project/sglang); each block
names the file (and commit) its shape comes from; values (ids, log-probs, paths, latencies) are made
up, keys and nesting are SGLang's. Adapter names follow graft's `<lora.name>-v<N>`.

The section "Recorded" at the end holds answers of a REAL server, copied verbatim: SGLang 0.5.23
(the PyPI wheel) serving graft's tiny fp32 qwen2 on this CPU machine, 2026-11-25 (how it runs:
docs/sglang-cpu.md). Where they and the reconstruction differ, the recordings are SGLang's behaviour
and the reconstructed shapes were brought in line (meta_info's extra keys; `rid` and
`http_worker_ipc` in every LoRAUpdateOutput).
"""

from __future__ import annotations

HTTP_SERVER = "python/sglang/srt/entrypoints/http_server.py@0025436eab0556737d615b36a4dd3e1e26e82f3d"
IO_STRUCT = "python/sglang/srt/managers/io_struct.py@001067fffe33427bee0ed2f007fb7551a1d76b44"
TOKENIZER_MANAGER = "python/sglang/srt/managers/tokenizer_manager.py@001067fffe33427bee0ed2f007fb7551a1d76b44"

# --- /generate request ------------------------------------------------------------------------
# GenerateReqInput (io_struct.py): input_ids, sampling_params (sampling/sampling_params.py@00c17caf:
# temperature, top_p, max_new_tokens, stop, n, ignore_eos, sampling_seed), return_logprob, lora_path
# (the loaded adapter's NAME: tokenizer_manager._resolve_lora_path looks it up in the LoRA registry).
GENERATE_REQUEST = {
    "input_ids": [791, 6864, 315, 9822, 374],
    "sampling_params": {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 3, "ignore_eos": False,
                        "stop": ["\n"], "sampling_seed": 5},
    "return_logprob": True,
    "lora_path": "policy-v3",
}
# n > 1 (GenerateReqInput._handle_parallel_sampling): one prompt becomes a batch of n; the answer
# is a list of n output dicts.
GENERATE_REQUEST_N = {
    "input_ids": [791, 6864, 315, 9822, 374],
    "sampling_params": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 3, "ignore_eos": False, "n": 2},
    "return_logprob": True,
}

# --- /generate answers ------------------------------------------------------------------------
# tokenizer_manager._handle_batch_output, non-streaming finished request (BatchStrOutput, i.e. the
# server runs its tokenizer): {"text", "output_ids", "meta_info"}; meta_info keys as built there and
# in add_logprob_to_meta_info; output_token_logprobs entries are detokenize_logprob_tokens' tuples
# (logprob, token_id, None) -> JSON arrays. finish_reason: schedule_batch.FINISH_LENGTH.to_json().
GENERATE_RESPONSE = {
    "text": " Paris.",
    "output_ids": [12366, 13, 198],
    "meta_info": {
        "id": "8c2a4f0e5b9d4c59a1f7e3b2d6c8a0f1",
        "finish_reason": {"type": "length", "length": 3},
        "prompt_tokens": 5,
        "weight_version": "default",
        "num_retractions": 0,
        "input_token_logprobs": [],  # not used by graft
        "output_token_logprobs": [[-0.2231, 12366, None], [-1.2040, 13, None], [-0.0513, 198, None]],
        "output_token_logprobs_length": 3,
        "reasoning_tokens": 0,
        "completion_tokens": 3,
        "cached_tokens": 0,
        "weight_versions": [{"version": "default", "start": 0, "end": 3}],
        "cached_tokens_details": None,
        "dp_rank": None,
        "e2e_latency": 0.0412,
        "response_sent_to_client_ts": 1795632589.049314,
    },
}
# FINISH_MATCHED_TOKEN.to_json() (schedule_batch.py): eos sampled.
GENERATE_RESPONSE_STOP = {
    "text": " Yes",
    "output_ids": [7566, 151643],
    "meta_info": {
        "id": "0d1e2f3a4b5c6d7e8f90a1b2c3d4e5f6",
        "finish_reason": {"type": "stop", "matched": 151643},
        "prompt_tokens": 5,
        "weight_version": "default",
        "num_retractions": 0,
        "input_token_logprobs": [],
        "output_token_logprobs": [[-0.6931, 7566, None], [-0.0101, 151643, None]],
        "output_token_logprobs_length": 2,
        "reasoning_tokens": 0,
        "completion_tokens": 2,
        "cached_tokens": 5,
        "weight_versions": [{"version": "default", "start": 0, "end": 2}],
        "cached_tokens_details": {"device": 5, "host": 0},
        "dp_rank": None,
        "e2e_latency": 0.0377,
        "response_sent_to_client_ts": 1795632589.1674087,
    },
}
# tokenizer_manager._collect_batch_responses: a batch (and n > 1) answers a list, in request order.
GENERATE_RESPONSE_N2 = [GENERATE_RESPONSE, GENERATE_RESPONSE_STOP]
# tokenizer_manager._handle_abort_req: an abort without an HTTP status (e.g. aborted in the waiting
# queue) is answered 200 with finish_reason type "abort".
GENERATE_RESPONSE_ABORT = {
    "text": "",
    "output_ids": [],
    "meta_info": {
        "id": "a1b2c3d4e5f60718293a4b5c6d7e8f90",
        "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
        "weight_version": "default",
        "e2e_latency": 0.3,
        "input_token_logprobs": [],
        "output_token_logprobs": [],
        "output_token_logprobs_length": 0,
        "completion_tokens": 0,
    },
}

# --- /generate errors -------------------------------------------------------------------------
# http_server.generate_request catches ValueError -> _create_error_response(e):
# ORJSONResponse({"error": {"message": str(e)}}, status_code=400). The message is
# tokenizer_manager._resolve_lora_path's for a name never loaded.
GENERATE_ERROR_UNKNOWN_LORA = (400, {"error": {"message": (
    "Got LoRA adapter that has never been loaded: policy-v9\n"
    "All loaded adapters: dict_keys(['policy-v3']).")}})
# tokenizer_manager._validate_one_request.
GENERATE_ERROR_TOO_LONG = (400, {"error": {"message": (
    "The input (600 tokens) is longer than the model's context length (512 tokens).")}})
# http_server's HTTPException handler (ErrorResponse.model_dump()); raised by
# tokenizer_manager._handle_abort_finish_reason for aborts with status 503/500 (message illustrative).
GENERATE_ERROR_UNAVAILABLE = (503, {"object": "error", "message": "The server is shutting down.",
                                    "type": "503", "param": None, "code": 503})
# http_server's RequestValidationError handler: 422 turned into 400 (message abbreviated).
GENERATE_ERROR_VALIDATION = (400, {"object": "error", "message": "1 validation error for GenerateReqInput",
                                   "type": "Bad Request", "param": None, "code": 400})

# --- LoRA adapters ----------------------------------------------------------------------------
# LoadLoRAAdapterReqInput / UnloadLoRAAdapterReqInput (io_struct.py).
LOAD_LORA_REQUEST = {"lora_name": "policy-v3", "lora_path": "/runs/r1/weights/adapter-v000003"}
UNLOAD_LORA_REQUEST = {"lora_name": "policy-v3"}
# http_server.load_lora_adapter / unload_lora_adapter: the LoRAUpdateOutput
# {success, error_message, loaded_adapters}, 200 if success else 400. loaded_adapters is
# lora_manager.create_lora_update_result's {lora_name: lora_path} of every adapter now loaded.
LOAD_LORA_OK = (200, {"rid": None, "http_worker_ipc": None, "success": True, "error_message": "",
                      "loaded_adapters": {"policy-v3": "/runs/r1/weights/adapter-v000003"}})
# lora/lora_manager.py validate_new_adapter.
LOAD_LORA_ALREADY = (400, {"rid": None, "http_worker_ipc": None, "success": False, "error_message": (
    "Failed to load LoRA adapter policy-v3 because it is already loaded"),
    "loaded_adapters": {"policy-v3": "/runs/r1/weights/adapter-v000003"}})
# managers/tokenizer_communicator_mixin.py@00096b5f load_lora_adapter, ValueError branch.
LOAD_LORA_NOT_ENABLED = (400, {"rid": None, "http_worker_ipc": None, "success": False, "error_message": (
    "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."), "loaded_adapters": None})
UNLOAD_LORA_OK = (200, {"rid": None, "http_worker_ipc": None, "success": True, "error_message": "",
                        "loaded_adapters": {}})
# lora/lora_registry.py@0270cffc LoRARegistry.unregister.
UNLOAD_LORA_UNKNOWN = (400, {"rid": None, "http_worker_ipc": None, "success": False, "error_message": (
    "LoRA with name policy-v9 does not exist. Loaded LoRAs: odict_keys(['policy-v3'])"),
    "loaded_adapters": None})

# --- base weights -----------------------------------------------------------------------------
# UpdateWeightFromDiskReqInput (io_struct.py): model_path (load_format, flush_cache, ... optional).
UPDATE_WEIGHTS_REQUEST = {"model_path": "/runs/r1/weights/merged-v000004"}
# http_server.update_weights_from_disk: {success, message, num_paused_requests}, 200 / 400. The
# message texts come from the scheduler's model runner, not read at a pinned commit: illustrative.
UPDATE_WEIGHTS_OK = (200, {"success": True, "message": "Succeeded to update model weights.",
                           "num_paused_requests": 0})
UPDATE_WEIGHTS_FAILED = (400, {"success": False, "message": (
    "Failed to get weights iterator: /runs/r1/weights/merged-v000099 (repr: FileNotFoundError). "
    "Rolling back to original weights."), "num_paused_requests": 0})
# Seen from SGLang 0.5.23 (this machine) when requests were still running at the update.
UPDATE_WEIGHTS_NOT_FLUSHED = (400, {"success": False, "message": (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. "
    "Retract or finish them, then call /flush_cache."), "num_paused_requests": 0})
# http_server.flush_cache: plain text, 200 if FlushCacheReqOutput.success else 400 (same text).
FLUSH_CACHE_TEXT = ("Cache flushed.\nPlease check backend logs for more details. "
                    "(When there are running or waiting requests, the operation will not be performed.)\n")
FLUSH_CACHE_OK = (200, FLUSH_CACHE_TEXT)
FLUSH_CACHE_REFUSED = (400, FLUSH_CACHE_TEXT)

# --- health -----------------------------------------------------------------------------------
# http_server.health_generate (GET /health and /health_generate): empty body; 503 while starting,
# shutting down, or when no generation answer came within SGLANG_HEALTH_CHECK_TIMEOUT (20 s).
HEALTH_OK = (200, "")
HEALTH_UNAVAILABLE = (503, "")


# === Recorded: answers of a real SGLang 0.5.23 server (see the module docstring) ===============
# (status, body) exactly as received; bodies parsed from JSON, or the text of a plain-text answer.
RECORDED_VERSION = "sglang 0.5.23 (PyPI wheel), tiny fp32 qwen2 (graft tiny-model, seed 0), CPU"

# POST /generate {"input_ids": [5, 6, 7, 8, 9], "sampling_params": {"temperature": 0,
#   "max_new_tokens": 4, "ignore_eos": true}, "return_logprob": true}
RECORDED_GENERATE = (200, {
    "text": " flower\u0001\u0012$", "output_ids": [850, 192, 209, 6],
    "meta_info": {"id": "fcfb69aa193f4dcabd8219b6e86490e9", "finish_reason": {"type": "length", "length": 4},
                  "prompt_tokens": 5, "weight_version": "default", "num_retractions": 0, "input_token_logprobs": [],
                  "output_token_logprobs": [[-6.508398532867432, 850, None], [-6.458697319030762, 192, None],
                                            [-6.491931438446045, 209, None], [-6.325403213500977, 6, None]],
                  "output_token_logprobs_length": 4, "reasoning_tokens": 0, "completion_tokens": 4,
                  "cached_tokens": 0, "weight_versions": [{"version": "default", "start": 0, "end": 4}],
                  "cached_tokens_details": None, "dp_rank": None, "e2e_latency": 0.19071352599894453,
                  "response_sent_to_client_ts": 1795632589.049314}})
# The same prompt with "lora_path": "policy-v1" (a PEFT adapter, rank 4, all linear layers).
RECORDED_GENERATE_LORA_TOKENS = [770, 360, 163, 163]
RECORDED_GENERATE_LORA_LOGPROBS = [-6.4710798263549805, -6.399001598358154, -6.42870569229126, -6.460287570953369]
# POST /generate {"input_ids": [5, 6, 7, 8, 9], "sampling_params": {"temperature": 0.7, "top_p": 0.9,
#   "max_new_tokens": 3, "n": 2, "sampling_seed": 5}, "return_logprob": true}: a list of n outputs.
RECORDED_GENERATE_N2 = (200, [
    {"text": "it planetocket", "output_ids": [308, 907, 942],
     "meta_info": {"id": "81bf916d343041f7ae44875208bc0605", "finish_reason": {"type": "length", "length": 3},
                   "prompt_tokens": 5, "weight_version": "default", "num_retractions": 0, "input_token_logprobs": [],
                   "output_token_logprobs": [[-7.133516311645508, 308, None], [-7.019596576690674, 907, None],
                                             [-6.942510604858398, 942, None]],
                   "output_token_logprobs_length": 3, "reasoning_tokens": 0, "completion_tokens": 3,
                   "cached_tokens": 4, "weight_versions": [{"version": "default", "start": 0, "end": 3}],
                   "cached_tokens_details": {"device": 4, "host": 0}, "dp_rank": None,
                   "e2e_latency": 0.03517778599962185, "response_sent_to_client_ts": 1795632589.1674087}},
    {"text": " dau explain protected", "output_ids": [886, 598, 715],
     "meta_info": {"id": "71c527fc7a614102b9a5531211258145", "finish_reason": {"type": "length", "length": 3},
                   "prompt_tokens": 5, "weight_version": "default", "num_retractions": 0, "input_token_logprobs": [],
                   "output_token_logprobs": [[-6.923368453979492, 886, None], [-6.950862884521484, 598, None],
                                             [-6.926446437835693, 715, None]],
                   "output_token_logprobs_length": 3, "reasoning_tokens": 0, "completion_tokens": 3,
                   "cached_tokens": 4, "weight_versions": [{"version": "default", "start": 0, "end": 3}],
                   "cached_tokens_details": {"device": 4, "host": 0}, "dp_rank": None,
                   "e2e_latency": 0.030686337000588537, "response_sent_to_client_ts": 1795632589.167435}}])

# /generate errors.
RECORDED_GENERATE_UNKNOWN_LORA = (400, {"error": {"message": (
    "Got LoRA adapter that has never been loaded: policy-v9\nAll loaded adapters: dict_keys(['policy-v1', "
    "'policy-v2']).")}})
RECORDED_GENERATE_LORA_NOT_ENABLED = (400, {"error": {"message": (
    "LoRA adapter 'policy-v9' was requested, but LoRA is not enabled. Please launch the server with "
    "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint.")}})
# A malformed body (sampling_params.temperature "hot"): "error" is a string here, not an object.
RECORDED_GENERATE_INVALID = (400, {"error": "invalid type: string \"hot\", expected f64"})
RECORDED_GENERATE_TOO_LONG = (400, {"error": {"message": (
    "The input (2098 tokens) is longer than the model's context length (2048 tokens).")}})

# /load_lora_adapter, /unload_lora_adapter (LoRAUpdateOutput, with rid and http_worker_ipc).
RECORDED_LOAD_OK = (200, {"rid": None, "http_worker_ipc": None, "success": True, "error_message": "",
                          "loaded_adapters": {"policy-v1": "/tmp/sgl/adapterA"}})
RECORDED_LOAD_SECOND_OK = (200, {"rid": None, "http_worker_ipc": None, "success": True, "error_message": "",
                                 "loaded_adapters": {"policy-v1": "/tmp/sgl/adapterA",
                                                     "policy-v2": "/tmp/sgl/adapterB"}})
RECORDED_LOAD_ALREADY = (400, {"rid": None, "http_worker_ipc": None, "success": False, "error_message": (
    "Failed to load LoRA adapter policy-v1 because it is already loaded"),
    "loaded_adapters": {"policy-v1": "/tmp/sgl/adapterA"}})
RECORDED_LOAD_MISSING_PATH = (400, {"rid": None, "http_worker_ipc": None, "success": False, "error_message": (
    "Repo id must be in the form 'repo_name' or 'namespace/repo_name': '/tmp/sgl/nope'. Use `repo_type` "
    "argument if needed."), "loaded_adapters": {"policy-v1": "/tmp/sgl/adapterA", "policy-v2": "/tmp/sgl/adapterB"}})
RECORDED_LOAD_NOT_ENABLED = (400, {"rid": None, "http_worker_ipc": None, "success": False, "error_message": (
    "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."), "loaded_adapters": None})
RECORDED_UNLOAD_OK = (200, {"rid": None, "http_worker_ipc": None, "success": True, "error_message": "",
                            "loaded_adapters": {"policy-v2": "/tmp/sgl/adapterB"}})
RECORDED_UNLOAD_UNKNOWN = (400, {"rid": None, "http_worker_ipc": None, "success": False, "error_message": (
    "LoRA with name policy-v1 does not exist. Loaded LoRAs: odict_keys(['policy-v2'])"), "loaded_adapters": None})

# /update_weights_from_disk, /flush_cache (plain text), /health.
RECORDED_UPDATE_WEIGHTS_OK = (200, {"success": True, "message": "Succeeded to update model weights.",
                                    "num_paused_requests": 0})
RECORDED_UPDATE_WEIGHTS_MISSING = (400, {"success": False, "message": (
    "Failed to get weights iterator: [Errno -2] Name or service not known."), "num_paused_requests": 0})
RECORDED_FLUSH_CACHE = (200, FLUSH_CACHE_TEXT)
RECORDED_HEALTH = (200, "")
