"""What tokens cost, in micro-units of the price table's currency (currency x
1,000,000) so Redis can add them up exactly as integers. A price per million
tokens times a token count *is* a micro-unit amount."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal

from budgets.ledger.writer import price_in_force
from budgets.models import ModelPrice


@dataclass(frozen=True)
class TokenPrice:
    input_per_million: Decimal
    output_per_million: Decimal
    price_id: int | None = None  # the ModelPrice version

    def cost_micro(self, *, input_tokens: int, output_tokens: int) -> int:
        amount = self.input_per_million * input_tokens + self.output_per_million * output_tokens
        return int(amount.to_integral_value(rounding=ROUND_HALF_UP))


def prices_in_force(*, models, at: datetime, pool_id: int | None = None) -> dict[str, TokenPrice]:
    """Each model's price in force on the pool (its own, else the model's)."""
    prices = {}
    for model in models:
        price = price_in_force(model=model, at=at, pool_id=pool_id)
        if price is not None:
            prices[model] = TokenPrice(price.input_per_million, price.output_per_million, price.pk)
    return prices


DEFAULT_CURRENCY = "USD"  # ModelPrice.currency's default


def price_table_currency() -> str:
    """The currency every amount on the pages is in: the price table's. A
    table that mixes currencies is named as such (its sums would be wrong,
    and the page must not pretend otherwise)."""
    currencies = sorted(set(ModelPrice.objects.values_list("currency", flat=True).distinct()))
    if len(currencies) > 1:
        return "mixed currencies: " + "/".join(currencies)
    return currencies[0] if currencies else DEFAULT_CURRENCY
