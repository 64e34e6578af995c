"""router: the front doors and the routing.

Doors: gRPC (server.py, grpc_health.py) and OpenAI-compatible HTTP (openai_http.py with
openai_protocol.py, chat_protocol.py / chat_template.py, tool_calls.py, structured_output.py,
openai_run.py / openai_choices.py / openai_logprobs.py / openai_responses.py, and the Responses
API in responses_protocol.py / responses_output.py), security.py, admission.py, errors.py,
metrics.py. Routing: Router (router.py) over its pools and health (pools.py, readiness.py),
worker choice (worker_choice.py with kv_index.py and policy.py), and one request's life
(request_life.py, handoff.py, worker_failures.py); settings.py is what the router runs with.
"""
