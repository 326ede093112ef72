//! What `verify` must report for the business-key binding damage that the
//! tests of both engines make (`pg::tests` on PostgreSQL,
//! `tests/corruption.rs` on a file, which includes this file by path), so
//! that the two checks are held to one list. Each test makes records
//! `gone` (finished, then past retention), `held`, `done` (finished),
//! `unbound`, `moved` and `other`, each with the business key `bk-<id>`,
//! then removes the bindings of `gone` and `unbound`, points `moved`'s at
//! `other`, and adds a binding of `bk-orphan` naming the absent key
//! `orphan` and one whose bytes (`\x00\xff`) do not parse, naming `held`.

/// Asserts that `found` (each problem's key and detail, in any order) is
/// what that damage must report, and nothing else: `unbound` has no
/// binding; `moved` is bound to `other`; the binding of `bk-moved` names
/// a record that does not carry it; `bk-orphan`'s names a key with no
/// record; the unparsable binding is named as such; `gone`, past
/// retention, needs none. `key` renders the key of an id as the report
/// does; `scope` is the keys' scope.
pub(crate) fn assert_reported(
    mut found: Vec<(String, String)>,
    scope: &str,
    key: impl Fn(&str) -> String,
) {
    found.sort();
    let mut expected = vec![
        (
            key("unbound"),
            "business key \"bk-unbound\" has no binding".to_string(),
        ),
        (
            key("moved"),
            format!(
                "business key \"bk-moved\" is bound to another key, {}",
                key("other")
            ),
        ),
        (
            format!("business key \"bk-moved\" in scope {scope}"),
            format!("names {}, whose record does not carry it", key("other")),
        ),
        (
            format!("business key \"bk-orphan\" in scope {scope}"),
            format!("names {}, which has no record", key("orphan")),
        ),
    ];
    expected.sort();
    let (unparsed, rest): (Vec<_>, Vec<_>) = found
        .into_iter()
        .partition(|(k, _)| k.starts_with("business key binding"));
    assert_eq!(rest, expected);
    assert_eq!(unparsed.len(), 1, "{unparsed:?}");
    assert!(
        unparsed[0].1.starts_with("binding key does not parse"),
        "{unparsed:?}"
    );
}
