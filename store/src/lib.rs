//! The sealed format.
