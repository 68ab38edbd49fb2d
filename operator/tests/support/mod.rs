//! What the operator's tests share: moto, Azurite, the Hub stand-in (hack/hub-server.py) and
//! deterministic data, all from sealed-test-support. A missing tool skips the test, or fails
//! it under SEALED_REQUIRE_SERVERS=1.
#![allow(dead_code)]

#[allow(unused_imports)]
pub use sealed_test_support::*;
