"""What both refit transports share: a stream of ``(name, tensor)`` pairs cut into groups of slots.

Modules: :mod:`.items` (checked items, slot layout, the types both sides use), :mod:`.pack` (the
sender half: :class:`~refit_verify.stream.pack.Packer`), :mod:`.unpack` (the receiver half: entry
checks, views, :class:`~refit_verify.stream.unpack.ReceiveState`).

May import: ``digest``, ``wire``, the foundation (``errors``, ``report``, ``config``, ``manifest``,
``compare``). Never: ``transport``, ``collective``, ``boundary``, ``engine``, ``trainer``, ``vllm_plugin``.
"""
