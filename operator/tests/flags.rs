//! The operator's duration flags: a value out of range is a usage error that names the
//! flag, the value and the allowed range, never a panic (which in a Deployment is a crash
//! loop).

use std::process::Command;

fn operator(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sealed-operator"))
        .args(args)
        .env_remove("SEALED_GC_INTERVAL")
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn durations_out_of_range_are_usage_errors() {
    for (flag, value) in [
        ("--gc-grace", "3000000000h"),
        ("--gc-interval", "3000000000h"),
        ("--upload-poll", "876001h"),
        ("--gc-grace", "99999999999999999999999h"),
    ] {
        let (code, stderr) = operator(&["run", flag, value]);
        assert_eq!(code, Some(2), "{flag} {value}: {stderr}");
        for part in [flag, value, "0 to 876000h", "longer than the maximum"] {
            assert!(
                stderr.contains(part),
                "{flag} {value}: no {part:?} in {stderr}"
            );
        }
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    let (code, stderr) = operator(&["run", "--gc-grace", "7d"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--gc-grace") && stderr.contains("'7d'") && stderr.contains("0 to 876000h"),
        "{stderr}"
    );
}
