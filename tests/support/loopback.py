"""The tests' HTTP calls: httpx's own, on one TLS context for the process. httpx builds a context for every
client it makes, about 20 ms of CPU loading the CA bundle, and the suite makes thousands of calls (all of them
plain HTTP to loopback)."""

import ssl
from functools import partial

import httpx

TLS = ssl.create_default_context()

Client = partial(httpx.Client, verify=TLS)
get = partial(httpx.get, verify=TLS)
post = partial(httpx.post, verify=TLS)
request = partial(httpx.request, verify=TLS)
