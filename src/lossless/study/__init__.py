"""The study: audits of any decoder against greedy AR token for token (`audit`, `candidates`), their records
(`records`), the report and its page (`report`, `htmlreport`, `templates/`) and the numerics probe (`probe`).

Uses decoding and the shared modules; decoding does not use it.
"""
