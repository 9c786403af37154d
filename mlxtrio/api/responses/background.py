"""Background mode of ``/v1/responses``: ``background: true``, polling, resuming
a stream, cancelling.

A background response runs as a job in the server's nursery (see
:mod:`mlxtrio.serving.jobs`), inside a call scope of its own, so the admission
place and the pinned cache prefix it holds are released when the *job* ends,
not when the request that started it does. Its record is stored as ``queued``
before the request is answered (a client that polls at once finds it) and
stored again with its final state, failed and cancelled included: a client
polling a background response must always learn how it ended.

Its events are kept in memory while the job is known, numbered by
``sequence_number`` from 0, so ``GET /v1/responses/{id}?stream=true
&starting_after=N`` resumes right after event N. A record still ``queued`` or
``in_progress`` that no job in this process runs belongs to a server that
stopped before finishing it; it is reported as failed.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import trio
from quart import Response, jsonify

from ...http.access_log import AccessRecord
from ...http.errors import ApiError, invalid_request, not_found
from ...http.sse import EventSink
from ...http.transport import client_domain
from ...serving.call import open_call_scope, services
from ...serving.jobs import Job
from ...serving.stream import produce
from .events import last_words
from .generate import ResponseEvents, ResponseTurn, begin, sse_response
from .objects import ResponseError
from .persist import persist
from .requests import ResponsesRequest
from .storage import open_store

log = logging.getLogger("mlxtrio.responses")

CANCEL_WAIT = 30.0  # seconds a cancel request waits for the job to stop


async def start_background(request: ResponsesRequest) -> Response:
    """Validate, store the queued response and start its job; answer with the
    queued Response object, or with its event stream when ``stream`` is set
    (the job goes on if that stream's client leaves)."""
    if request.store is False:
        raise invalid_request(
            "background responses must be stored so they can be polled: "
            "set store to true (or omit it)",
            "store",
        )
    open_store(
        "cannot start a background response",
        invalid_request("background mode requires a response store to be configured", "background"),
    )
    job, queued = await services().start_job(_run_job, request)
    if request.stream:
        return follow_job(job, after=-1)
    return jsonify(queued)


async def _run_job(
    request: ResponsesRequest, task_status: trio.TaskStatus[tuple[Job, dict[str, Any]]]
) -> None:
    """The job: prepared and stored in its own call scope (an error up to
    there is the request's answer), then generated to its end. Nothing it
    raises afterwards may reach the server's nursery: a bug ends the job as
    failed, stored and announced, like any other failure."""
    svc = services()
    record = AccessRecord("POST", "/v1/responses (background)")
    async with open_call_scope(svc, record):
        run = await begin(request)
        response = run.response
        response.status = "queued"
        if not await persist(run.turn, response):
            raise ApiError(
                503,
                "cannot start a background response: it could not be stored; retry later",
                "server_error",
                code="store_unavailable",
            )
        job = Job(response.id, run.turn.owner, snapshot=response.wire)
        events = ResponseEvents(run, job.log.append, lambda: True, keep_unfinished=True)
        try:
            svc.jobs.add(job)
            task_status.started((job, response.wire()))
            await _generate(run, job, events)
            record.status = 200
        except Exception:
            log.exception("background response %s failed", response.id)
            await _end_failed(run, job)
        finally:
            job.finish()


async def _generate(run: ResponseTurn, job: Job, events: ResponseEvents) -> None:
    """Generate until done or cancelled by the client; the final state is
    stored (shielded: a cancel that arrives while it is written does not
    undo it) and announced."""
    response = run.response
    with trio.CancelScope() as generation:
        job.running_in(generation)
        await produce(run.prepared, events)
    if generation.cancelled_caught and response.status not in FINISHED:
        await events.assembler.mark_cancelled()
        with trio.CancelScope(shield=True):
            await persist(run.turn, response)
        await events.assembler.announce()
        log.info("background response %s cancelled by its client", response.id)


async def _end_failed(run: ResponseTurn, job: Job) -> None:
    """The last resort after a bug, relying on nothing that may have failed:
    the response is set failed and stored, and its followers get the
    stream's last words (a terminal ``error`` event)."""
    response = run.response
    if response.status in FINISHED:
        return
    response.status = "failed"
    response.error = ResponseError(code="server_error", message="internal server error")
    with contextlib.suppress(Exception), trio.CancelScope(shield=True):
        await persist(run.turn, response)
    await job.log.append("error", last_words(len(job.log.events)))


FINISHED = frozenset({"completed", "incomplete", "failed", "cancelled"})


def follow_job(job: Job, after: int) -> Response:
    """The job's events after sequence number ``after`` as an SSE stream;
    the client leaving ends only this stream."""

    async def write(sink: EventSink) -> None:
        async for event, data in job.log.follow(after + 1):
            await sink.send(event, data)

    response, _ = sse_response(write, {})
    return response


def live_job(response_id: str) -> Job | None:
    """The job of ``response_id`` in this process, if the caller may see it."""
    job = services().jobs.get(response_id)
    if job is None or job.owner != client_domain():
        return None
    return job


async def stop_job(response_id: str) -> None:
    """Cancel the job of ``response_id`` (if this process runs it) and wait,
    boundedly, until its final state is written."""
    job = live_job(response_id)
    if job is not None:
        job.cancel()
        with trio.move_on_after(CANCEL_WAIT):
            await job.done.wait()


async def delete_job(response_id: str) -> None:
    """Stop the job of a response being deleted and forget it, so neither its
    last write nor its kept events bring the response back."""
    await stop_job(response_id)
    if live_job(response_id) is not None:
        services().jobs.forget(response_id)


def orphaned(record: dict[str, Any]) -> dict[str, Any]:
    """A stored background response that no job here runs any more: a server
    stopped before it finished, so it never will; say so."""
    if not record.get("background") or record.get("status") not in ("queued", "in_progress"):
        return record
    return {
        **record,
        "status": "failed",
        "error": {
            "code": "server_error",
            "message": "the server stopped before this background response finished; "
            "create it again",
        },
    }


async def cancel(response_id: str, stored: dict[str, Any] | None) -> Response:
    """Cancel a background response and answer with its final state. One
    that already ended is returned unchanged (cancelling is idempotent)."""
    job = live_job(response_id)
    if job is not None:
        await stop_job(response_id)
        return jsonify(job.snapshot())
    if stored is None:
        raise not_found(f'Response "{response_id}" not found or expired')
    if not stored.get("background"):
        raise invalid_request(
            "only background responses can be cancelled (this one was not created "
            "with background: true)",
            "response_id",
        )
    return jsonify(orphaned(stored))
