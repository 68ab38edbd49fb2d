//! Generates the CRD YAML of `sealed-crds`.
//!
//! ```text
//! crdgen            write crds/yaml/<group>_<plural>.yaml (the checked-in files)
//! crdgen --stdout   print every CRD as one multi-document YAML stream (for kubectl apply -f -)
//! crdgen --check    exit 1 when the checked-in files differ from the types
//! ```

use std::process::ExitCode;

fn main() -> ExitCode {
    let arg = std::env::args().nth(1);
    let files = match sealed_crds::generated_files() {
        Ok(f) => f,
        Err(e) => {
            eprintln!("crdgen: cannot serialize the CRDs: {e}");
            return ExitCode::FAILURE;
        }
    };
    let dir = sealed_crds::yaml_dir();
    match arg.as_deref() {
        None | Some("--write") => {
            if let Err(e) = std::fs::create_dir_all(&dir) {
                eprintln!("crdgen: cannot create {}: {e}", dir.display());
                return ExitCode::FAILURE;
            }
            for (name, text) in &files {
                let path = dir.join(name);
                if let Err(e) = std::fs::write(&path, text) {
                    eprintln!("crdgen: cannot write {}: {e}", path.display());
                    return ExitCode::FAILURE;
                }
                eprintln!("crdgen: wrote {}", path.display());
            }
            ExitCode::SUCCESS
        }
        Some("--stdout") => {
            for (_, text) in &files {
                print!("{text}");
            }
            ExitCode::SUCCESS
        }
        Some("--check") => {
            let mut ok = true;
            for (name, text) in &files {
                let path = dir.join(name);
                if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
                    eprintln!(
                        "crdgen: {} is out of date; run `cargo run -p sealed-crds --bin crdgen`",
                        path.display()
                    );
                    ok = false;
                }
            }
            if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Some(other) => {
            eprintln!(
                "crdgen: unknown argument {other:?}; usage: crdgen [--write|--stdout|--check]"
            );
            ExitCode::from(2)
        }
    }
}
