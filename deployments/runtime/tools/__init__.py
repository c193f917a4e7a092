"""Command lines: ``make models`` (prepare), ``make engines`` (build), ``make plan`` (plan); no replica imports them."""
