"""Host adapters: each maps one serving engine's calls onto pdplug's Protocols.

An adapter is a package named after its engine (``pdplug.adapters.vllm``; the SGLang one
beside it): ``__init__`` (``register()`` for the engine's plugin group and its version gate),
the engine's interface class, scheduler-side bookkeeping, the worker side, what travels in
the engine's request, stats.

What is not about one engine lives in the modules of this package itself, one job each, and
every adapter imports it from here (``docs/architecture.md``):

* :mod:`pdplug.adapters.room_ids`: bootstrap room ids (``RoomAllocator``, the room bounds);
* :mod:`pdplug.adapters.resolve`: a decode rank's lookup of a prefill instance that fails
  fast on one that recently did not answer (``Resolver``);
* :mod:`pdplug.adapters.push`: a step's send jobs cut into the segments a KV sender posts
  (``SendJob``, ``PushCursor``, ``segments_for_job``) and the step's readiness
  (``step_ready``);
* :mod:`pdplug.adapters.placement`: where a worker sits (``RankPlacement``);
* :mod:`pdplug.adapters.version`: which engine releases an adapter supports
  (``VersionGate``);
* :mod:`pdplug.adapters.wire`: the key, bind and advertised host of an adapter's sockets
  (``adapter_wire``).

Flat modules here rather than a ``common`` sub-package: an engine's adapter is a folder, a
shared piece is a file, so ``pdplug.adapters.<name>`` is either one engine or one job that
every engine shares, and a shared module is never a grab-bag. None of them imports an engine.
"""
