"""Alerts: findings that fire, escalate or resolve become Alertmanager-style webhook
notifications, written to a durable outbox with the finding and posted from it.

  config.py    the receivers file: where alerts go and which ones
  rules.py     a finding's alert: name, labels, annotations, fingerprint
  webhook.py   the wire format: Alertmanager's webhook body (v4), Standard Webhooks signing, the POST
  outbox.py    alert and notification rows, written in the finding's transaction; read back for delivery
  delivery.py  the writer process's thread that posts due notifications, with backoff
"""
