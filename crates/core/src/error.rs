//! Error values for everything that reads a checkpoint. Each variant carries
//! enough context (file, tensor, field) that a user can act on the message.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {message}")]
    Json { path: PathBuf, message: String },
    #[error("config: field `{field}`: expected {expected}, found {actual}")]
    Config { field: String, expected: String, actual: String },
    #[error("{file}: {message}")]
    Safetensors { file: PathBuf, message: String },
    #[error("tensor `{tensor}` in {file}: {message}")]
    Tensor { tensor: String, file: PathBuf, message: String },
    #[error("tensor `{tensor}` is missing (checked {searched})")]
    MissingTensor { tensor: String, searched: String },
    #[error("{count} tensor(s) in the checkpoint are not used by the model, e.g. `{example}` in {file}")]
    UnusedTensors { count: usize, example: String, file: PathBuf },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("{0}")]
    Other(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }

    pub fn config(field: impl Into<String>, expected: impl ToString, actual: impl ToString) -> Self {
        Error::Config { field: field.into(), expected: expected.to_string(), actual: actual.to_string() }
    }
}
