//! Secrets given to the command line: a key is read from a file
//! (`--key-file`), the environment or, last, the flag itself. A flag's value
//! is readable by every local user in `/proc/PID/cmdline`; a file or the
//! environment is not.

use std::path::{Path, PathBuf};

/// A key file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("failed to read {flag} {path}: {source}")]
    Read {
        flag: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{flag} {path} is empty: put the key in it (one line)")]
    Empty { flag: &'static str, path: PathBuf },
}

impl SecretError {
    pub fn category(&self) -> &'static str {
        match self {
            SecretError::Read { .. } => "key_file",
            SecretError::Empty { .. } => "key_file",
        }
    }
}

/// The key from `file` (named `flag` in errors) if given, else `value`
/// (the flag or its environment variable); surrounding white space is
/// dropped, an empty value counts as none.
pub fn key_from(
    value: Option<&str>,
    file: Option<&Path>,
    flag: &'static str,
) -> Result<Option<String>, SecretError> {
    if let Some(path) = file {
        let text = std::fs::read_to_string(path).map_err(|source| SecretError::Read {
            flag,
            path: path.into(),
            source,
        })?;
        let key = text.trim();
        if key.is_empty() {
            return Err(SecretError::Empty { flag, path: path.into() });
        }
        return Ok(Some(key.to_string()));
    }
    Ok(value.map(str::trim).filter(|k| !k.is_empty()).map(str::to_string))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_file_wins_and_is_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        std::fs::write(&path, "  ck_secret\n").unwrap();
        assert_eq!(key_from(Some("flag"), Some(&path), "--key-file").unwrap().as_deref(), Some("ck_secret"));
        assert_eq!(key_from(Some(" flag "), None, "--key-file").unwrap().as_deref(), Some("flag"));
        assert_eq!(key_from(Some(" "), None, "--key-file").unwrap(), None);
        std::fs::write(&path, "\n").unwrap();
        let e = key_from(None, Some(&path), "--key-file").unwrap_err();
        assert!(e.to_string().contains("is empty"), "{e}");
        let e = key_from(None, Some(&dir.path().join("nope")), "--key-file").unwrap_err();
        assert!(e.to_string().starts_with("failed to read --key-file"), "{e}");
    }
}
