//! Helpers the guest tests share: example binaries to run as peer processes
//! and signals to stop, resume or kill them.
#![allow(dead_code)]

/// The path of an example binary (`cargo test` builds them beside the
/// test binaries).
pub fn example(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        bin.exists(),
        "{} must be built (cargo test builds examples)",
        bin.display()
    );
    bin
}

/// Sends `sig` (`STOP`, `CONT`) to `child` with `kill(1)`.
pub fn signal(child: &tokio::process::Child, sig: &str) {
    let pid = child.id().expect("the child is running").to_string();
    let st = std::process::Command::new("kill")
        .args([&format!("-{sig}"), &pid])
        .status()
        .unwrap();
    assert!(st.success(), "kill -{sig} {pid}");
}
