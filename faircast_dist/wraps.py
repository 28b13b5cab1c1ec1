"""An adapter's patch surface as one reversible list: each wrap records the original it replaces.

An integration (``deepspeed_hooks.install``, ``megatron_patches.install`` / ``activate``) builds
one :class:`Wraps` and calls :meth:`Wraps.wrap` once per point it changes, in one place, so the
list of what Fair Cast touches in a framework is that code; :meth:`Wraps.uninstall` puts every
original back (stock behaviour, bit for bit). Framework-free.
"""
from __future__ import annotations

from typing import Any, Callable

_ABSENT = object()  # the owner had no attribute of its own (an instance reading its class's method)
_SHARED: dict[tuple[int, str], list] = {}  # (id(owner), name) -> [owner, original, users]


class Wraps:
    """The wraps one install made, in order; :meth:`uninstall` undoes them in reverse order."""

    def __init__(self):
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> Any:
        """Replace ``owner.name`` (a module, class or instance attribute) by ``make(current)``.

        Args:
            owner: what holds the attribute; an instance whose method comes from its class gets
                an attribute of its own, deleted again by :meth:`uninstall`.
            name: the attribute.
            make: ``current value -> replacement`` (usually a ``functools.wraps`` wrapper).

        Returns:
            The replacement.

        Raises:
            AttributeError: ``owner`` has no attribute ``name``.
        """
        return self.set(owner, name, make(getattr(owner, name)))

    def set(self, owner: Any, name: str, value: Any) -> Any:
        """Set ``owner.name = value`` (e.g. a back-reference the adapter adds), undone by :meth:`uninstall`."""
        saved = vars(owner).get(name, _ABSENT)
        setattr(owner, name, value)
        self._undo.append(lambda: delattr(owner, name) if saved is _ABSENT else setattr(owner, name, saved))
        return value

    def wrap_shared(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """Like :meth:`wrap` for a module-global function that several installs share (one wrapper
        dispatching to each install's own state): installed by the first user, the original put back
        when the last user uninstalls, whatever the order."""
        key = (id(owner), name)
        if key not in _SHARED:
            original = getattr(owner, name)
            setattr(owner, name, make(original))
            _SHARED[key] = [owner, original, 0]
        _SHARED[key][2] += 1

        def release():
            entry = _SHARED[key]
            entry[2] -= 1
            if entry[2] == 0:
                setattr(entry[0], name, entry[1])
                del _SHARED[key]
        self._undo.append(release)

    def on_uninstall(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` at :meth:`uninstall` (in reverse order with the wraps), e.g. to unregister."""
        self._undo.append(undo)

    def uninstall(self) -> None:
        """Put back every original, newest first. Idempotent."""
        while self._undo:
            self._undo.pop()()
