//! The tool's error: what failed, for a person, with its causes.

use std::error::Error as _;
use std::io;

/// Everything that makes a subcommand stop. Each variant's message says
/// what the tool was doing; the cause (if any) is its `source`.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The command line was refused (clap's message, on one line).
    #[error("{0}")]
    Usage(String),

    /// A store operation failed.
    #[error("{context}")]
    Store {
        /// What the tool was doing.
        context: String,
        /// The store's error.
        #[source]
        source: idemstore::Error,
    },

    /// An operating-system call (starting a thread) failed.
    #[error("{context}")]
    Io {
        /// What the tool was doing.
        context: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// Writing to stdout failed; a closed pipe is not reported.
    #[error("cannot write output")]
    Output(#[from] io::Error),

    /// Anything else that went wrong (a worker thread panicked).
    #[error("{0}")]
    Failed(String),
}

impl CliError {
    /// A store error with what the tool was doing.
    pub fn store(context: impl Into<String>, source: idemstore::Error) -> CliError {
        CliError::Store {
            context: context.into(),
            source,
        }
    }

    /// An OS error with what the tool was doing.
    pub fn io(context: impl Into<String>, source: io::Error) -> CliError {
        CliError::Io {
            context: context.into(),
            source,
        }
    }

    /// A refused command line, as one line: clap's first line without its
    /// `error: ` prefix, plus its tip if it gives one.
    pub fn usage(err: &clap::Error) -> CliError {
        let text = err.render().to_string();
        let mut raw = text.lines().peekable();
        let first = raw.next().map_or("invalid command line", str::trim);
        let mut message = first.strip_prefix("error: ").unwrap_or(first).to_owned();
        // Indented lines right after the first one continue it (clap lists
        // the missing arguments there).
        while let Some(more) = raw.next_if(|l| l.starts_with(' ') && !l.trim().is_empty()) {
            message.push(' ');
            message.push_str(more.trim());
        }
        let mut lines = raw.map(str::trim).filter(|l| !l.is_empty());
        if let Some(tip) = lines.find(|l| l.starts_with("tip: ")) {
            message.push_str("; ");
            message.push_str(tip);
        }
        message.push_str(" (see --help)");
        CliError::Usage(message)
    }

    /// Whether the error, or any of its causes, is a closed pipe.
    pub fn is_broken_pipe(&self) -> bool {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(err) = cause {
            if err
                .downcast_ref::<io::Error>()
                .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
            {
                return true;
            }
            cause = err.source();
        }
        false
    }

    /// The message and every cause, joined with `: `, on one line.
    pub fn one_line(&self) -> String {
        let mut line = self.to_string();
        let mut cause = self.source();
        while let Some(err) = cause {
            line.push_str(": ");
            line.push_str(&err.to_string());
            cause = err.source();
        }
        line.split_whitespace().collect::<Vec<_>>().join(" ")
    }
}
