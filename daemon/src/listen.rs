//! Where the daemon listens: its runtime directory's two sockets, bound
//! here (refusing a live daemon's, replacing a stale one) or passed by
//! systemd socket activation and told apart by name or path.

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

/// The sockets of one daemon.
#[derive(Clone, Debug)]
pub struct RuntimeDir {
    pub dir: PathBuf,
}

impl RuntimeDir {
    /// Where engines register.
    pub fn control(&self) -> PathBuf {
        self.dir.join("control.sock")
    }

    /// Where frontends ask.
    pub fn query(&self) -> PathBuf {
        self.dir.join("query.sock")
    }
}

/// Makes `dir` the daemon's runtime directory: created with `mode`
/// whatever the umask, or, if it exists, checked to be a directory of this
/// daemon's user (not a symlink) and given `mode`. Another user's
/// directory is refused: whoever can write it can replace the sockets
/// with their own and answer every frontend.
pub(crate) fn prepare_dir(dir: &Path, mode: u32) -> io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let refuse = |why: String| io::Error::new(io::ErrorKind::PermissionDenied, why);
    if std::fs::symlink_metadata(dir).is_err() {
        if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)?;
        }
        match std::fs::DirBuilder::new().mode(mode).create(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    let meta = std::fs::symlink_metadata(dir)?;
    if !meta.file_type().is_dir() {
        return Err(refuse(format!(
            "{} is not a directory (a symlink or a file); refusing to use it as the runtime directory",
            dir.display()
        )));
    }
    let me = rustix::process::geteuid().as_raw();
    if meta.uid() != me {
        return Err(refuse(format!(
            "{} belongs to uid {}, not to this daemon's uid {me}; another user could replace its sockets",
            dir.display(),
            meta.uid()
        )));
    }
    if meta.mode() & 0o7777 != mode {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode))?;
    }
    Ok(())
}

/// Binds a socket (mode 0660, non-blocking), refusing to take over a live
/// daemon's, and removing a stale one only if it is a socket of this
/// daemon's user.
pub(crate) fn bind(path: &Path) -> io::Result<UnixListener> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let me = rustix::process::geteuid().as_raw();
        if !meta.file_type().is_socket() || meta.uid() != me {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "{} exists and is not a socket of uid {me}; not touching it",
                    path.display()
                ),
            ));
        }
        if UnixStream::connect(path).is_ok() {
            return Err(io::Error::new(
                io::ErrorKind::AddrInUse,
                format!("{} belongs to a running daemon", path.display()),
            ));
        }
        std::fs::remove_file(path)?;
    }
    let l = UnixListener::bind(path)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
    l.set_nonblocking(true)?;
    Ok(l)
}

/// Why the sockets systemd passed cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ActivationError {
    #[error("passed socket `{name}` ({path}) is neither control nor query")]
    Unknown { name: String, path: String },
    #[error("two passed sockets for `{0}`")]
    Twice(String),
    #[error("socket activation passed no control socket or no query socket")]
    Missing,
}

/// Which passed socket is which: by `FileDescriptorName=` (`control`,
/// `query`), else by the socket's path (`…/control.sock`, `…/query.sock`).
pub(crate) fn activated_listeners(
    fds: Vec<(String, OwnedFd)>,
) -> Result<(UnixListener, UnixListener), ActivationError> {
    let mut control = None;
    let mut query = None;
    for (name, fd) in fds {
        let path = rustix::net::getsockname(&fd)
            .ok()
            .and_then(|a| rustix::net::SocketAddrUnix::try_from(a).ok())
            .and_then(|u| u.path().map(|p| p.to_string_lossy().into_owned()));
        let is = |what: &str| {
            name == what
                || path
                    .as_deref()
                    .is_some_and(|p| p.ends_with(&format!("{what}.sock")))
        };
        let slot = if is("control") {
            &mut control
        } else if is("query") {
            &mut query
        } else {
            return Err(ActivationError::Unknown {
                path: path.unwrap_or_else(|| "no path".into()),
                name,
            });
        };
        if slot.is_some() {
            return Err(ActivationError::Twice(name));
        }
        *slot = Some(UnixListener::from(fd));
    }
    match (control, query) {
        (Some(c), Some(q)) => Ok((c, q)),
        _ => Err(ActivationError::Missing),
    }
}
