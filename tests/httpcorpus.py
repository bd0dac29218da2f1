"""Request smuggling and malformed HTTP/1.1, each with the status the agent answers it with:
the unit test (tests/unit/test_web_limits.py) sends them to the server, the guest test
(tests/host/test_attacks_socket.py) to the installed agent as a hostile local user. Plain
bytes, no imports: the guest's attacker process loads this alone."""

from __future__ import annotations

H = b"Host: x\r\n"
CHUNKED = b"POST /echo HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n"
SMUGGLING = [
    # Transfer-Encoding: repeated, listed, obfuscated, or with a Content-Length.
    (b"POST /echo HTTP/1.1\r\n" + H + b"Transfer-Encoding: gzip\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked, chunked\r\n\r\n0\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\n" + H + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\n" + H + b"Transfer-Encoding: xchunked\r\n\r\n0\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\n" + H + b"Transfer-Encoding : chunked\r\n\r\n0\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\n" + H + b"Transfer-Encoding:\x0bchunked\r\n\r\n0\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\n" + H + b"X: 1\r\n Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\n" + H + b"Content-Length: 3\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    # Content-Length: conflicting, signed, hex, absurdly long.
    (b"POST /echo HTTP/1.1\r\n" + H + b"Content-Length: 1\r\nContent-Length: 2\r\n\r\nab", 400),
    (b"POST /echo HTTP/1.1\r\n" + H + b"Content-Length: +1\r\n\r\na", 400),
    (b"POST /echo HTTP/1.1\r\n" + H + b"Content-Length: 0x1\r\n\r\na", 400),
    (b"POST /echo HTTP/1.1\r\n" + H + b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n", 400),
    (b"POST /echo HTTP/1.1\r\n" + H + b"Content-Length: " + b"0" * 19 + b"1\r\n\r\na", 400),
    # Header values: NUL, bare CR, bytes over 0x7f.
    (b"GET /echo HTTP/1.1\r\n" + H + b"X: a\x00b\r\n\r\n", 400),
    (b"GET /echo HTTP/1.1\r\n" + H + b"X: a\rb\r\n\r\n", 400),
    (b"GET /echo HTTP/1.1\r\n" + H + b"X: caf\xc3\xa9\r\n\r\n", 400),
    (b"GET /echo HTTP/1.1\r\n" + H + b"X: \x80\r\n\r\n", 400),
    # Chunk sizes: whitespace around them, signs, hex prefixes, control bytes in extensions.
    (CHUNKED + b"1 \r\na\r\n0\r\n\r\n", 400),
    (CHUNKED + b" 1\r\na\r\n0\r\n\r\n", 400),
    (CHUNKED + b"1\t\r\na\r\n0\r\n\r\n", 400),
    (CHUNKED + b"0x1\r\na\r\n0\r\n\r\n", 400),
    (CHUNKED + b"+1\r\na\r\n0\r\n\r\n", 400),
    (CHUNKED + b"1;a\rb\r\na\r\n0\r\n\r\n", 400),
    (CHUNKED + b"1\r\nab\r\n0\r\n\r\n", 400),
    (CHUNKED + b"fffffffffffffffff\r\na\r\n0\r\n\r\n", 400),
    # The request line: lower-case methods, versions, Host.
    (b"get /echo HTTP/1.1\r\n" + H + b"\r\n", 400),
    (b"Get /echo HTTP/1.1\r\n" + H + b"\r\n", 400),
    (b"GET /echo HTTP/1.9\r\n" + H + b"\r\n", 505),
    (b"GET /echo HTTP/2.0\r\n" + H + b"\r\n", 505),
    (b"GET /echo HTTP/0.9\r\n" + H + b"\r\n", 505),
    (b"GET /echo http/1.1\r\n" + H + b"\r\n", 400),
    (b"GET /echo HTTP/1.1\r\n\r\n", 400),
    (b"GET /echo HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400),
    (b"GET * HTTP/1.1\r\n" + H + b"\r\n", 400),
]  # fmt: skip
