"""UCX backend over ``ucxx`` (asyncio API), usable from any thread.

Lifecycle of one connection (sender P -> receiver D):

1. P connects to D's listener (``ucx://host:port#incarnation``): the control path.
2. D refuses a connection on another interface, or one that cannot prove the cluster token.
3. P sends HELLO (wire version, layout, model); D answers HELLO_OK or HELLO_REJECT.
4. P opens the data path from the UCX worker address and tag that HELLO_OK carried.
5. ``send_layer`` groups a chunk's layers into messages: control, then payload, tagged.
6. D keeps receives posted ahead in staging slots; a landing thread scatters each payload.
7. Once a transfer has landed, D sends ACK to every sender of it (NACK when it drops one).
8. Pull path (same host, CUDA pools): D maps P's pools and copies the blocks itself.
9. On close P sends BYE on the data path; a dead peer is seen on the control path.

One process-wide runtime (``pdserve.kvtransfer.ucx_runtime``) owns the ucxx context and an
asyncio event loop in a daemon thread; senders and receivers share it (reference counted) and
block on it through ``asyncio.run_coroutine_threadsafe``. UCX picks the transport (``UCX_TLS``
unset): TCP and shared memory (posix, sysv, cma) on a CPU host; cuda_ipc / cuda_copy / RDMA
where present.

The loop thread shares the GIL with the engine thread of a worker; a thread waiting for the GIL
waits up to ``sys.getswitchinterval()`` each time, several times per message. The runtime lowers
it to ``PDSERVE_GIL_SWITCH_INTERVAL_S`` (what that changes under a busy engine: docs/results.md,
"Figures behind the code's choices").

ucxx runs with ``enable_python_future=True`` (its notifier thread completes asyncio
futures): the default polling mode spins the event loop at 100% CPU whenever a receive
is posted, i.e. always on an idle receiver.

Modules: ``sender`` (``UcxSender``: ``send_layer``, message groups, the GPU waiter),
``sender_loop`` (the sender's links on the event loop: connect, handshake, post, replies),
``receiver`` (``UcxReceiver``: listener, handshake, receives, landing, replies), ``common``
(the token check; what is closed at exit). Environment variables: see
``pdserve.kvtransfer.ucx_runtime``.
"""

from pdserve.kvtransfer.ucx.receiver import UcxReceiver
from pdserve.kvtransfer.ucx.sender import UcxSender

__all__ = ["UcxReceiver", "UcxSender"]
