"""From the ``model`` a request names to the engine that serves it, and what
the request path needs to know of that engine's model."""

from __future__ import annotations

import weakref

from ..engine.engine import Engine, EngineState
from ..engine.model import LoadedModel
from ..grammar.compiler import GrammarCompiler
from ..grammar.planning import OutputFacts
from ..http.errors import ApiError, not_found, unavailable
from .call import access_record, on_call_end, services
from .residency import Resident, UnknownModel


def known(model: str) -> Resident:
    """The served model ``model`` names (a name or an alias); a 404 for a
    name the server does not know. Loads nothing."""
    try:
        return services().models.resolve(model)
    except UnknownModel as exc:
        raise not_found(str(exc)) from None


async def resolve(model: str) -> Engine:
    """The engine serving ``model``, loaded first if it is not (see
    :meth:`.residency.Residency.acquire`): a 404 for a name the server does
    not know, a 429 when too many wait for its load, a 503 while it cannot
    serve (no room to load it, restarting, failed). The model counts as in
    use until the call ends: it is not unloaded meanwhile. Cancellation: the
    wait for a load stops; the load goes on."""
    resident = known(model)
    residency = services().models
    on_call_end(residency.use(resident))
    access_record().model = resident.name
    engine = await residency.acquire(resident)
    if engine.state is EngineState.LOADING:
        raise unavailable(f"Model {engine.name!r} is still loading; retry shortly")
    if engine.state is EngineState.RESTARTING:
        raise unavailable(f"Model {engine.name!r} is restarting after an engine failure; retry")
    if engine.state is not EngineState.READY:  # why is in the log and /health
        raise ApiError(
            503, f"Model {engine.name!r} is not serving ({engine.state.value})", "server_error"
        )
    return engine


# One grammar compiler (and its cache of compiled grammars) per loaded model,
# gone with it.
_compilers: weakref.WeakKeyDictionary[LoadedModel, GrammarCompiler] = weakref.WeakKeyDictionary()


def output_facts(engine: Engine) -> OutputFacts:
    """What constraint planning needs of ``engine``'s (loaded) model."""
    loaded = engine.loaded
    assert loaded is not None, "output_facts() of a model that is not loaded"
    grammars = _compilers.get(loaded)
    if grammars is None and loaded.grammar_tokenizer is not None:
        grammars = _compilers[loaded] = GrammarCompiler(loaded.grammar_tokenizer)
    return OutputFacts.of(engine.name, loaded, grammars)
