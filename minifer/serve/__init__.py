"""The OpenAI-compatible HTTP server (``python -m minifer.serve``) on the serving engine
(`minifer.engine`): routes, the protocol's request checks and replies, the chat endpoint, the
guards between the network and the routes, and Prometheus metrics."""
