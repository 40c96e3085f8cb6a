//! Compile-time promises: every mistake the macros catch has a case under `ui/<area>/` with the
//! error a user sees in its `.stderr`; the forms they accept compile under `ui/pass/`.
//!
//! After a deliberate change of a message, refresh the `.stderr` files with
//! `TRYBUILD=overwrite cargo test -p outbox-tests --test ui` and review the diff.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("ui/event/*.rs");
    t.compile_fail("ui/tx/*.rs");
    t.compile_fail("ui/subscriber/*.rs");
    t.compile_fail("ui/router/*.rs");
    t.pass("ui/pass/*.rs");
}
