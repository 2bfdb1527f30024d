"""NIXL backend (NVIDIA's inference transfer library, ``pip install 'pdserve[nixl]'``).

The UCX backend's wire messages (``pdserve.kvtransfer.layout``) on a TCP control path, with NIXL
moving the bytes. Lifecycle of one connection (sender P -> receiver D):

1. P connects over TCP to D's ``nixl://host:port/<incarnation>``; frames are length-prefixed.
2. D admits P: its interface, then the cluster token by challenge and response.
3. P sends HELLO: layout, model, its NIXL agent's metadata and pools, the op it asks for.
4. D answers HELLO_OK with its offer: its pools (DIRECT), staging slots (WRITE) or none (READ).
5. DIRECT: P WRITEs the blocks into D's reserved blocks, then sends LAYER; D records it.
6. WRITE: P gathers a layer into a slot, WRITEs it, sends LAYER; D scatters it, sends CREDIT.
7. READ: P sends LAYER with its source ids; D READs the blocks and scatters them.
8. Once a transfer has landed, D sends ACK to every sender of it (NACK when it drops one).
9. Before a dropped transfer's blocks go back, D FENCEs its DIRECT senders; each answers FENCED.
10. On close P sends BYE.

In every mode the sender keeps its blocks until the ACK (the prefill worker releases them after
``finish``). Descriptors are what a NIXL transfer costs on a GPU: its UCX plugin moves each one
as a CUDA IPC copy of its own, so the per-block descriptors of scattered blocks (DIRECT) run far
slower than one descriptor per layer, and every mode is slower on a GPU than the UCX backend,
which gathers with one kernel: a sender on CUDA pools logs a warning once (the figures:
docs/results.md, "Figures behind the code's choices").

Modules: ``sender`` (``NixlSender``: ``send_layer``, the links' control path), ``sender_posting``
(each link's sending thread: WRITE, DIRECT and its fences, READ requests), ``receiver``
(``NixlReceiver``), ``control`` (the TCP frames, the address), ``agent`` (NIXL itself: loading,
agents, registration, descriptors). Environment: ``PDSERVE_NIXL_SLOT_BYTES`` (default 16 MiB) and
``PDSERVE_NIXL_SLOTS`` (default 4), the receiver's staging per WRITE connection.
"""

from pdserve.kvtransfer.nixl.agent import load_nixl
from pdserve.kvtransfer.nixl.control import FENCE_TIMEOUT_S, SCHEME, parse_address
from pdserve.kvtransfer.nixl.receiver import NixlReceiver
from pdserve.kvtransfer.nixl.sender import OPS, NixlSender

__all__ = ["FENCE_TIMEOUT_S", "NixlReceiver", "NixlSender", "OPS", "SCHEME", "load_nixl", "parse_address"]
