// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// The rendezvous store: a TCP key-value server (run by rank 0 or by the launcher) and its
/// clients, like c10d's TCPStore but safe to expose:
///  * it binds the address it is given, never every interface unless asked ("0.0.0.0" / "::");
///  * with a token (DDP_TOKEN) a client must prove it knows it: HMAC-SHA-256 over a fresh nonce
///    from each side, compared in constant time, so a recorded handshake cannot be replayed and
///    the token never crosses the wire; the server proves it too;
///  * frames are length-prefixed and capped; a client that has not authenticated may only send a
///    handshake-sized frame; buffers grow with the bytes that actually arrive, never with a
///    length someone claims;
///  * every call has a timeout, and waits are enforced by the server, so a client is never left
///    reading a late reply.
///
/// The parts: ddp/store/protocol.hpp (StoreOptions, frames), ddp/store/engine.hpp
/// (detail::StoreEngine: the server's logic without I/O, fuzzed), ddp/store/server.hpp
/// (StoreServer) and ddp/store/client.hpp (Store). This header includes them all, for programs
/// that use the store on its own; this comment is the store's security design, which the parts
/// refer to.

#include "ddp/store/client.hpp"
#include "ddp/store/protocol.hpp"
#include "ddp/store/server.hpp"
