//! Engine tests on a real server.
