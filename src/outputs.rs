//! Writing outputs without harming anything: every file glmcheck writes goes to a temp file beside
//! its destination and is renamed into place, so a reader never sees half a report; temp files of an
//! interrupted run are removed by [`remove_pending`] (the binary calls it on Ctrl-C).

use std::path::{Path, PathBuf};
use std::sync::Mutex;

static PENDING: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// The temp path used for `dest`: hidden, in the same directory (so the rename is atomic), unique to
/// this process.
pub fn temp_for(dest: &Path) -> PathBuf {
    let dir = dest
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = dest
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    dir.join(format!(".{name}.glmcheck-{}.tmp", std::process::id()))
}

/// Runs `write(tmp)` then renames `tmp` to `dest`; on any failure the temp file is removed.
pub fn write_atomically<E>(
    dest: &Path,
    write: impl FnOnce(&Path) -> Result<(), E>,
) -> Result<(), AtomicError<E>> {
    let tmp = temp_for(dest);
    if let Ok(mut p) = PENDING.lock() {
        p.push(tmp.clone());
    }
    let result = write(&tmp)
        .map_err(AtomicError::Write)
        .and_then(|()| std::fs::rename(&tmp, dest).map_err(AtomicError::Rename));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    if let Ok(mut p) = PENDING.lock() {
        p.retain(|t| t != &tmp);
    }
    result
}

#[derive(Debug)]
pub enum AtomicError<E> {
    Write(E),
    Rename(std::io::Error),
}

impl<E: std::fmt::Display> std::fmt::Display for AtomicError<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AtomicError::Write(e) => write!(f, "{e}"),
            AtomicError::Rename(e) => write!(f, "rename into place failed: {e}"),
        }
    }
}

impl<E: std::fmt::Debug + std::fmt::Display> std::error::Error for AtomicError<E> {}

/// Removes the temp files (and temp directories) of writes still in flight (for an interrupt
/// handler).
pub fn remove_pending() {
    if let Ok(p) = PENDING.lock() {
        for t in p.iter() {
            if t.is_dir() {
                let _ = std::fs::remove_dir_all(t);
            } else {
                let _ = std::fs::remove_file(t);
            }
        }
    }
}

/// Registers a temp path that a write builds on its own (a whole directory, say): an interrupt
/// removes it ([`remove_pending`]) until [`forget_pending`] is called.
pub fn add_pending(tmp: &Path) {
    if let Ok(mut p) = PENDING.lock() {
        p.push(tmp.to_path_buf());
    }
}

/// Unregisters a temp path of [`add_pending`] (it was renamed into place or removed).
pub fn forget_pending(tmp: &Path) {
    if let Ok(mut p) = PENDING.lock() {
        p.retain(|t| t != tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interrupt_mid_write_removes_the_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("dump.safetensors");
        let r: Result<(), AtomicError<String>> = write_atomically(&dest, |tmp| {
            std::fs::write(tmp, b"half a dump").map_err(|e| e.to_string())?;
            assert!(tmp.exists());
            // What the Ctrl-C handler does while this write is in flight.
            remove_pending();
            assert!(!tmp.exists(), "the temp file survived the interrupt");
            Err("interrupted".to_string())
        });
        assert!(r.is_err());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn an_interrupt_removes_a_pending_temp_directory() {
        let dir = tempfile::tempdir().unwrap();
        let tmp = temp_for(&dir.path().join("out"));
        std::fs::create_dir(&tmp).unwrap();
        std::fs::write(tmp.join("model-00001-of-00001.safetensors"), b"half").unwrap();
        add_pending(&tmp);
        remove_pending();
        forget_pending(&tmp);
        assert!(!tmp.exists(), "the temp directory survived the interrupt");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_failed_write_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("r.json");
        let r: Result<(), AtomicError<String>> = write_atomically(&dest, |tmp| {
            std::fs::write(tmp, b"partial").map_err(|e| e.to_string())?;
            Err("boom".to_string())
        });
        assert!(r.is_err());
        assert!(!dest.exists());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        write_atomically::<String>(&dest, |tmp| {
            std::fs::write(tmp, b"{}").map_err(|e| e.to_string())
        })
        .unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), b"{}");
    }
}
