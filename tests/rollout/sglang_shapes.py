"""SGLang native-API request and response shapes, reconstructed from SGLang's source
(github.com/sgl-project/sglang) for the client tests and the fake server. Each block names the file
(and commit) its shape comes from; values (ids, log-probs, paths, latencies) are made up, keys and
nesting are SGLang's. Adapter names follow graft's `<lora.name>-v<N>`.
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
        "e2e_latency": 0.0412,
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
        "e2e_latency": 0.0377,
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
LOAD_LORA_OK = (200, {"success": True, "error_message": "",
                      "loaded_adapters": {"policy-v3": "/runs/r1/weights/adapter-v000003"}})
# lora/lora_manager.py validate_new_adapter.
LOAD_LORA_ALREADY = (400, {"success": False, "error_message": (
    "Failed to load LoRA adapter policy-v3 because it is already loaded"),
    "loaded_adapters": {"policy-v3": "/runs/r1/weights/adapter-v000003"}})
# managers/tokenizer_communicator_mixin.py@00096b5f load_lora_adapter, ValueError branch.
LOAD_LORA_NOT_ENABLED = (400, {"success": False, "error_message": (
    "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."), "loaded_adapters": None})
UNLOAD_LORA_OK = (200, {"success": True, "error_message": "", "loaded_adapters": {}})
# lora/lora_registry.py@0270cffc LoRARegistry.unregister.
UNLOAD_LORA_UNKNOWN = (400, {"success": False, "error_message": (
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
