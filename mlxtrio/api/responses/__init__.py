"""The OpenAI Responses API: ``/v1/responses`` over HTTP (JSON and SSE) and
WebSocket, stored responses, background mode, ``input_tokens`` and ``compact``.

Imports run one way, from the wire up:

* wire models: ``requests``, ``items``, ``tools`` (what clients send) and
  ``objects`` (the Response object and its items);
* ``convert`` (input items -> messages), ``chain`` (``previous_response_id``
  continuations), ``storage`` (the store and its errors);
* ``turn`` (a request as a turn: chain read, input mapped and checked);
* ``persist`` (write-ahead, then announce), ``events`` (the assembler and the
  stream's ending), ``generate`` (a turn through the serving pipeline);
* transports and routes: ``routes`` (create), ``background``, ``socket``,
  ``compact``, ``stored``.
"""

from . import compact, routes, socket, stored

# Registration order: the static /v1/responses/compact and /input_tokens
# before /v1/responses/<response_id> (Werkzeug ranks them so anyway; the order
# states the intent).
BLUEPRINTS = (compact.blueprint, socket.blueprint, routes.blueprint, stored.blueprint)

__all__ = ["BLUEPRINTS"]
