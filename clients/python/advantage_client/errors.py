"""The one error the clients raise (:class:`AdvantageError`), defined by the contract."""

from advantage_contract.errors import AdvantageError

__all__ = ["AdvantageError"]
