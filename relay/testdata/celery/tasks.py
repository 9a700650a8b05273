"""A Celery app for relay's real-worker tests (celery_test.go).

Run by Debian's python3-celery (5.2) as
    python3 -m celery -A tasks worker -Q <queues> --pool solo
with CELERY_BROKER_URL (the test's own Redis), CELERY_KEYPREFIX (Kombu's
global_keyprefix: the relay's --redis-namespace plus ":", or empty) and
CELERY_RECORD_KEY. Each run of tasks.record RPUSHes what the worker made of
the message (task id, args, kwargs, queue, priority, trace context, the
tenant header "apartment", when it ran) as JSON onto CELERY_RECORD_KEY, under the key prefix too.
"""
import json
import os
import time

import redis
from celery import Celery

PREFIX = os.environ.get("CELERY_KEYPREFIX", "")

app = Celery("stagedrain_celery_test", broker=os.environ["CELERY_BROKER_URL"])
app.conf.update(
    broker_transport_options={"global_keyprefix": PREFIX} if PREFIX else {},
    task_default_queue="celery",
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)

_records = redis.Redis.from_url(os.environ["CELERY_BROKER_URL"])


@app.task(name="tasks.record", bind=True)
def record(self, *args, **kwargs):
    info = self.request.delivery_info or {}
    _records.rpush(PREFIX + os.environ["CELERY_RECORD_KEY"], json.dumps({
        "id": self.request.id,
        "task": self.name,
        "args": list(args),
        "kwargs": kwargs,
        "queue": info.get("routing_key"),
        "priority": info.get("priority"),
        "traceparent": getattr(self.request, "traceparent", None),
        "tracestate": getattr(self.request, "tracestate", None),
        "apartment": getattr(self.request, "apartment", None),
        "ran_at": time.time(),
    }))
