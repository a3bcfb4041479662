"""Machine-readable error codes and the error value that carries one."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class ErrorCode(StrEnum):
    """Why a request was refused. The one list of codes: dead letters, logs and tests use it.

    Parse (the bytes are not a request at all):
      EMPTY_MESSAGE (no value, or zero bytes), MESSAGE_TOO_LARGE (over max_message_bytes),
      INVALID_UTF8, INVALID_JSON (also NaN/Infinity, duplicate keys, nesting too deep),
      INVALID_UNICODE (a string or key holds a lone UTF-16 surrogate escape such as "\\ud800":
      valid JSON grammar, but no text; RFC 7493 forbids it), NOT_AN_OBJECT (top-level JSON is
      not an object), UNSUPPORTED_SCHEMA_VERSION, INVALID_CLOUDEVENT (a structured-mode
      CloudEvent that breaks CloudEvents 1.0 or carries no JSON request: specversion not
      "1.0", id, source or type missing or empty, a datacontenttype that is not JSON, no
      data, both data and data_base64, data_base64 not base64, a batch of events),
      BATCH_TOO_LARGE (the record batch that holds the record decompresses to more than the
      worker's bound, consumer.max_batch_bytes: none of its records is read; the batch
      gets one dead letter, at its last offset, whose message names its offsets and whose
      original is empty: the bytes stay in the input topic).

    Framing (a pipeline told its values carry the Confluent wire format: a 0x00 magic
    byte, a 4-byte big-endian schema id, then the JSON):
      NOT_FRAMED (the value does not start with the magic byte and an id: shorter than five
      bytes, or another first byte), SCHEMA_ID_UNKNOWN (the schema registry has no schema
      with that id), SCHEMA_NOT_JSON (the id names a schema of another type, Avro or
      Protobuf, not JSON Schema).

    Contract (a field breaks the request schema):
      MISSING_FIELD (`id` only when the worker gave no fallback id), UNKNOWN_FIELD,
      WRONG_TYPE (a JSON value of the wrong type, e.g. state as a number, samples as "many"),
      INVALID_ID (empty or control characters), ID_TOO_LONG (over 128 characters),
      STATE_TOO_LARGE (over max_state_chars, a JSON state counted as its text), NO_QUESTIONS
      (neither questions nor question_set, or empty questions), QUESTIONS_AND_SET (both
      given), TOO_MANY_QUESTIONS, INVALID_QUESTION_ID (not ^[A-Za-z][A-Za-z0-9_]{0,63}$),
      UNKNOWN_QUESTION_KIND (type not noul/yes_no/choice/score), EMPTY_INSTRUCTIONS (blank
      text, or a yes/no question with neither instructions nor a described outcome),
      INSTRUCTIONS_TOO_LONG (over 2000 characters, JSON counted as its text),
      TOO_FEW_OPTIONS / TOO_MANY_OPTIONS (a choice needs 2..26: one read carries one
      single-token label per option, A..Z; Jev itself takes 255, so a Jev body with 27..255
      options is refused here), DUPLICATE_OPTION (same name ignoring case and surrounding
      space), INVALID_OPTION_NAME (blank, over 64 characters, or control characters),
      TOO_FEW_LEVELS / TOO_MANY_LEVELS (a score needs 2..10), DUPLICATE_LEVEL (also when a
      null level's name, "level <i>", is another level's), INVALID_LEVEL_NAME (blank or
      control characters), INVALID_SAMPLES (not 1..16), INVALID_AUTO_OPTIONS (auto_threshold
      not > 0, auto_max not 2..16, or either without samples "auto"), INVALID_REPLY_TOPIC (not a
      Kafka topic name), INVALID_METADATA (not an object, or nested too deeply to echo back),
      INVALID_VALUE (any other value the schema refuses: e.g. a JSON state, instructions or
      description nested more than 64 deep; a `model` empty, over 128 characters or with
      control characters). STATE_AND_INPUT (a body gives both `state` and OpenAI
      moderation's `input`, whose text parts are the state), TOO_MANY_IMAGES (more than 8
      images in all: `images`, `input`'s image parts and Jev's `assets`), INVALID_IMAGE_SOURCE
      (an image that is neither a base64 data URL of an image/* type nor an http(s) URL with a
      host and no user name; a Jev asset without data_base64, or with a multipart `part`).

    Graph (how questions refer to each other):
      UNKNOWN_DEPENDENCY (depends_on / ask_if names a question not in the request),
      DEPENDENCY_CYCLE (a question depends on itself, directly or through others),
      INVALID_ASK_IF_VALUE (an ask_if value that the referenced question cannot answer, or an
      empty list of values).

    Pipeline (raised by the worker once the request has parsed):
      UNKNOWN_QUESTION_SET (question_set names no configured set), LABEL_NOT_SINGLE_TOKEN (a
      label is not one token), LABEL_POSITION_MISMATCH (labels do not land at the same template
      position), DUPLICATE_LABEL_TOKEN (two labels of a question share a token),
      TEMPLATE_TOO_LONG (a question's answer template does not fit the canvas).

    Images (the worker's checks of each image's bytes, after parsing; dgstream.workers.images):
      IMAGE_UNREADABLE (not an image in a format the worker reads: PNG, JPEG, GIF, WebP,
      BMP; or its EXIF block cannot be read), IMAGE_TRUNCATED (the file ends before its
      pixels do), IMAGE_TOO_LARGE (more pixels than images.max_pixels, read from the header
      before any decoding: a decompression bomb; or more bytes than images.max_image_bytes),
      IMAGE_URL_NOT_ALLOWED (a URL while fetching is off, outside images.fetch_allow, a
      redirect off the list, or a host that resolves to a private, loopback or link-local
      address the list does not name), IMAGE_FETCH_FAILED (the server refused or answered
      other than 200, too many redirects, the connection failed), IMAGE_FETCH_TIMEOUT (the
      fetch took longer than images.fetch_timeout_s, however slowly the bytes came),
      IMAGE_WRONG_CONTENT_TYPE (the server's Content-Type is not image/*).

    Inputs the engine does not read (the request is valid; answering from its text alone
    would be a silently wrong answer):
      IMAGES_NOT_READ (the request carries images, all valid, and the pipeline's engine reads
      no images: `EngineInfo.reads_images`), INSTRUCTIONS_NOT_READ (reserved, no longer
      produced: request-level `instructions` were refused so until the prompt placed them;
      every engine's prompt now does, and the value stays for consumers that match on it).

    Engine:
      ENGINE_FAILED (the engine could not answer; the request itself may be fine),
      POISON (the record was in flight, alone, in several worker incarnations that died: an
      engine crash on it, or the process killed while it ran; it is not tried again).

    Output (the answer exists but cannot be delivered where the request asks):
      OUTPUT_TOO_LARGE (the result is larger than the destination topic accepts: its
      max.message.bytes, or the worker producer's max_request_size), REPLY_TOPIC_NOT_ALLOWED
      (reply_topic is outside the pipeline's reply_topics allow-list, an internal topic such
      as __consumer_offsets, or one of the pipeline's own input or dead-letter topics),
      REPLY_TOPIC_UNKNOWN (no such topic: the worker creates none), REPLY_TOPIC_NOT_WRITABLE
      (the worker is not authorized to write to it).

    An outage (the engine or the output topic out of reach) is never a code: the worker
    holds the work and tries again.
    """

    # parse
    EMPTY_MESSAGE = "EMPTY_MESSAGE"
    MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"
    INVALID_UTF8 = "INVALID_UTF8"
    INVALID_JSON = "INVALID_JSON"
    INVALID_UNICODE = "INVALID_UNICODE"
    NOT_AN_OBJECT = "NOT_AN_OBJECT"
    UNSUPPORTED_SCHEMA_VERSION = "UNSUPPORTED_SCHEMA_VERSION"
    INVALID_CLOUDEVENT = "INVALID_CLOUDEVENT"
    BATCH_TOO_LARGE = "BATCH_TOO_LARGE"
    # framing
    NOT_FRAMED = "NOT_FRAMED"
    SCHEMA_ID_UNKNOWN = "SCHEMA_ID_UNKNOWN"
    SCHEMA_NOT_JSON = "SCHEMA_NOT_JSON"
    # contract
    MISSING_FIELD = "MISSING_FIELD"
    UNKNOWN_FIELD = "UNKNOWN_FIELD"
    WRONG_TYPE = "WRONG_TYPE"
    INVALID_ID = "INVALID_ID"
    ID_TOO_LONG = "ID_TOO_LONG"
    STATE_TOO_LARGE = "STATE_TOO_LARGE"
    NO_QUESTIONS = "NO_QUESTIONS"
    QUESTIONS_AND_SET = "QUESTIONS_AND_SET"
    TOO_MANY_QUESTIONS = "TOO_MANY_QUESTIONS"
    INVALID_QUESTION_ID = "INVALID_QUESTION_ID"
    UNKNOWN_QUESTION_KIND = "UNKNOWN_QUESTION_KIND"
    EMPTY_INSTRUCTIONS = "EMPTY_INSTRUCTIONS"
    INSTRUCTIONS_TOO_LONG = "INSTRUCTIONS_TOO_LONG"
    TOO_FEW_OPTIONS = "TOO_FEW_OPTIONS"
    TOO_MANY_OPTIONS = "TOO_MANY_OPTIONS"
    DUPLICATE_OPTION = "DUPLICATE_OPTION"
    INVALID_OPTION_NAME = "INVALID_OPTION_NAME"
    TOO_FEW_LEVELS = "TOO_FEW_LEVELS"
    TOO_MANY_LEVELS = "TOO_MANY_LEVELS"
    DUPLICATE_LEVEL = "DUPLICATE_LEVEL"
    INVALID_LEVEL_NAME = "INVALID_LEVEL_NAME"
    INVALID_SAMPLES = "INVALID_SAMPLES"
    INVALID_AUTO_OPTIONS = "INVALID_AUTO_OPTIONS"
    INVALID_REPLY_TOPIC = "INVALID_REPLY_TOPIC"
    INVALID_METADATA = "INVALID_METADATA"
    INVALID_VALUE = "INVALID_VALUE"
    STATE_AND_INPUT = "STATE_AND_INPUT"
    TOO_MANY_IMAGES = "TOO_MANY_IMAGES"
    INVALID_IMAGE_SOURCE = "INVALID_IMAGE_SOURCE"
    # graph
    UNKNOWN_DEPENDENCY = "UNKNOWN_DEPENDENCY"
    DEPENDENCY_CYCLE = "DEPENDENCY_CYCLE"
    INVALID_ASK_IF_VALUE = "INVALID_ASK_IF_VALUE"
    # pipeline
    UNKNOWN_QUESTION_SET = "UNKNOWN_QUESTION_SET"
    LABEL_NOT_SINGLE_TOKEN = "LABEL_NOT_SINGLE_TOKEN"
    LABEL_POSITION_MISMATCH = "LABEL_POSITION_MISMATCH"
    DUPLICATE_LABEL_TOKEN = "DUPLICATE_LABEL_TOKEN"
    TEMPLATE_TOO_LONG = "TEMPLATE_TOO_LONG"
    # images
    IMAGE_UNREADABLE = "IMAGE_UNREADABLE"
    IMAGE_TRUNCATED = "IMAGE_TRUNCATED"
    IMAGE_TOO_LARGE = "IMAGE_TOO_LARGE"
    IMAGE_URL_NOT_ALLOWED = "IMAGE_URL_NOT_ALLOWED"
    IMAGE_FETCH_FAILED = "IMAGE_FETCH_FAILED"
    IMAGE_FETCH_TIMEOUT = "IMAGE_FETCH_TIMEOUT"
    IMAGE_WRONG_CONTENT_TYPE = "IMAGE_WRONG_CONTENT_TYPE"
    # inputs the engine does not read
    IMAGES_NOT_READ = "IMAGES_NOT_READ"
    INSTRUCTIONS_NOT_READ = "INSTRUCTIONS_NOT_READ"  # reserved: no longer produced
    # engine
    ENGINE_FAILED = "ENGINE_FAILED"
    POISON = "POISON"
    # output
    OUTPUT_TOO_LARGE = "OUTPUT_TOO_LARGE"
    REPLY_TOPIC_NOT_ALLOWED = "REPLY_TOPIC_NOT_ALLOWED"
    REPLY_TOPIC_UNKNOWN = "REPLY_TOPIC_UNKNOWN"
    REPLY_TOPIC_NOT_WRITABLE = "REPLY_TOPIC_NOT_WRITABLE"


class RequestError(BaseModel):
    """A refusal: the code, a message for people that names the field, and the field's path."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    code: ErrorCode
    message: str = Field(description="For people; names the offending field.")
    field: str | None = Field(
        default=None,
        description="Dotted path of the offending field (`questions.q1.criteria`); null when "
        "the message as a whole is at fault.",
    )

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


class RequestRejected(Exception):
    """A `RequestError` as an exception, for code paths (the engine) that raise rather than return.

    `RequestRejected(error)` or `RequestRejected(code, message, field)`.
    """

    def __init__(
        self,
        error: RequestError | ErrorCode,
        message: str | None = None,
        field: str | None = None,
    ) -> None:
        if not isinstance(error, RequestError):
            error = RequestError(code=error, message=message or str(error), field=field)
        elif message is not None or field is not None:
            raise TypeError("pass either a RequestError or a code with its message and field")
        super().__init__(error)
        self.error = error

    @property
    def code(self) -> ErrorCode:
        return self.error.code

    def __str__(self) -> str:
        return str(self.error)
