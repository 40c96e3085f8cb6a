//! Shared support for the examples.
