"""Transport only, for every API: error envelopes (:mod:`.errors`), SSE framing
with keepalives and the drain deadline (:mod:`.sse`), guards (auth, Host,
Origin, body limits: :mod:`.security`, :mod:`.body`, :mod:`.transport`),
delivery tracking and the access log. Knows no API's events."""
