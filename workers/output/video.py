"""Clips as stored objects: encoding (on the writer thread) and reading back (`verify --deep`,
`report`), with PyAV, FFmpeg's Python binding, whose wheels carry the encoders.

mp4   H.264 (libx264), yuv420p: what every player and `datasets`' Video feature read
webm  AV1 (libsvtav1, else libaom-av1), yuv420p: smaller at the same quality, slower to encode

A clip with sound (LTX-2's vocoder output) carries it as a second stream: AAC in mp4, Opus in webm
(resampled to 48 kHz, the rate every Opus decoder gives), at the model's channels (mono or stereo).

A clip's frames are the pipeline's output as it made them (PIL images, one size); its frame rate
is the row's `fps` (Wan's pipelines take none: it is the rate they were trained at). Encoding is
deterministic for the same frames and settings (one encoder thread, the muxer's `bitexact`: no
random segment id or date in the file), so a retried clip has the same bytes.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from fractions import Fraction

from fleetgen.errors import FleetgenError

# --video-format -> (container, encoders in order of preference, codec name as decoders report it)
VIDEO_FORMATS = {"mp4": ("mp4", ("libx264",), "h264"), "webm": ("webm", ("libsvtav1", "libaom-av1"), "av1")}
AUDIO_CODECS = {"mp4": "aac", "webm": "libopus"}  # FFmpeg's own AAC encoder; libopus is in PyAV's wheels
AUDIO_BITRATE = 192_000  # bits/s for a stereo track (half for mono)
OPUS_RATE = 48000  # Opus decoders give 48 kHz whatever rate it was encoded from: it is stored at that
MAX_CRF = {"mp4": 51, "webm": 63}
POSTER_QUALITY = 90  # the poster frame's JPEG quality


class VideoUnavailable(Exception):
    """PyAV is not installed, or its FFmpeg lacks the format's encoder."""


@dataclass
class Clip:
    """One clip on its way to the store: its frames until the writer encodes them."""

    frames: list  # PIL images, first to last
    fps: float
    audio: object = None  # its sound: float samples in [-1, 1], (channels, samples), or None (a silent clip)
    sample_rate: int = 0  # of `audio`

    @property
    def size(self) -> tuple[int, int]:
        return self.frames[0].size


def clips_of(videos, asked: int | None, fps: float, made_by: str, audio=None, sample_rate: int = 0) -> list[Clip]:
    """A video pipeline's output (per prompt, its frames as PIL images; LTX-2's also a waveform per
    prompt, (channels, samples)) as clips at `fps`; a clip of another length than `asked` is an
    error, never stored as if asked."""
    tracks = [None] * len(videos) if audio is None else [a.float().cpu().numpy() for a in audio]
    clips = [Clip(list(frames), fps, track, sample_rate) for frames, track in zip(videos, tracks, strict=True)]
    lengths = {len(c.frames) for c in clips}
    if asked is not None and lengths != {asked}:
        raise FleetgenError(f"{made_by} made {', '.join(map(str, sorted(lengths)))} frames where {asked} were asked")
    return clips


def _av():
    os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its whole configuration per clip otherwise
    try:
        import av
    except ImportError as err:
        raise VideoUnavailable(
            "video output needs PyAV: `pip install 'fleetgen[video]'` (or `pip install av`) where the job runs"
        ) from err
    return av


def encoder(video_format: str) -> str:
    """The encoder this machine has for `video_format`; raises VideoUnavailable."""
    av = _av()
    _, names, _ = VIDEO_FORMATS[video_format]
    for name in names:
        if name in av.codecs_available:
            return name
    raise VideoUnavailable(
        f"`--video-format {video_format}` needs one of the encoders {', '.join(names)}, and this PyAV's FFmpeg "
        f"has none (PyAV {av.__version__}); use `--video-format mp4`"
    )


def _rate(fps: float) -> Fraction:
    return Fraction(fps).limit_denominator(1001)  # 23.976 -> 24000/1001


def encode_clip(clip: Clip, video_format: str, crf: int) -> tuple[bytes, dict]:
    """(the clip's bytes, what its record gains: duration, codec; for a clip with sound its
    audio_codec and sample_rate)."""
    av = _av()
    container, _, codec = VIDEO_FORMATS[video_format]
    width, height = clip.size
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container, container_options={"fflags": "+bitexact"}) as out:
        stream = out.add_stream(encoder(video_format), rate=_rate(clip.fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        # one thread: the same frames give the same bytes (x264's threads change its decisions)
        stream.options = {"crf": str(crf), **({"svtav1-params": "lp=1"} if codec == "av1" else {})}
        stream.thread_count = 1
        # every stream is added before the first packet is written (the header names them all)
        sound, frame = _audio_stream(av, out, clip, video_format) if clip.audio is not None else (None, None)
        for picture in clip.frames:
            for packet in stream.encode(av.VideoFrame.from_image(picture.convert("RGB"))):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
        if sound is not None:
            for packet in [*sound.encode(frame), *sound.encode(None)]:
                out.mux(packet)
    info = {"duration": round(len(clip.frames) / clip.fps, 4), "codec": codec}
    if sound is not None:
        info.update(audio_codec=sound.codec_context.codec.name.removeprefix("lib"), sample_rate=sound.rate)
    return buf.getvalue(), info


def _audio_stream(av, out, clip: Clip, video_format: str):
    """(the container's audio stream, the clip's sound as one frame for it)."""
    import numpy as np

    samples = np.clip(np.asarray(clip.audio, dtype=np.float32), -1.0, 1.0)
    samples = samples[None] if samples.ndim == 1 else samples
    channels = samples.shape[0]
    if channels not in (1, 2):
        raise ValueError(f"a clip's sound has {channels} channels; 1 or 2 can be stored")
    layout = "stereo" if channels == 2 else "mono"
    name = AUDIO_CODECS[video_format]
    rate = OPUS_RATE if name == "libopus" else clip.sample_rate
    stream = out.add_stream(name, rate=rate, layout=layout)  # PyAV resamples and re-frames for the encoder
    stream.bit_rate = AUDIO_BITRATE * channels // 2
    stream.thread_count = 1
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples), format="fltp", layout=layout)
    frame.sample_rate, frame.pts = clip.sample_rate, 0
    return stream, frame


def poster(clip: Clip) -> bytes:
    """The clip's first frame as JPEG (`report`'s thumbnail)."""
    buf = io.BytesIO()
    clip.frames[0].convert("RGB").save(buf, format="JPEG", quality=POSTER_QUALITY)
    return buf.getvalue()


@dataclass(frozen=True)
class ClipInfo:
    frames: int
    fps: float
    width: int
    height: int
    codec: str
    audio_codec: str | None = None  # its sound's codec (aac, opus), None for a silent clip
    sample_rate: int = 0
    audio_samples: int = 0  # per channel, decoded (decode=True only)


def read_clip(data: bytes, decode: bool = True) -> ClipInfo:
    """What a stored clip holds; `decode` reads every frame (what `verify --deep` checks: a clip
    whose header is whole but whose frames are damaged fails here). Raises ValueError when the
    bytes are not a clip."""
    av = _av()
    try:
        with av.open(io.BytesIO(data), mode="r") as f:
            if not f.streams.video:
                raise ValueError("no video stream")
            stream = f.streams.video[0]
            sound = f.streams.audio[0] if f.streams.audio else None
            frames = samples = 0
            if decode:  # every packet of both streams, in the file's order
                for frame in f.decode(*[s for s in (stream, sound) if s is not None]):
                    if isinstance(frame, av.AudioFrame):
                        samples += frame.samples
                    else:
                        frames += 1
            else:
                frames = stream.frames
            rate = stream.average_rate or stream.guessed_rate
            codec = stream.codec_context.codec.canonical_name  # av1, whichever decoder read it
            audio = (
                (sound.codec_context.codec.name.removeprefix("lib"), sound.codec_context.sample_rate)
                if sound
                else (None, 0)
            )
            return ClipInfo(frames, float(rate), stream.width, stream.height, codec, *audio, samples)
    except av.FFmpegError as err:
        raise ValueError(f"not a readable clip: {err}") from err


def decode_frames(data: bytes) -> list:
    """Every frame of a stored clip as a PIL image, in order (`fleetgen score` reads clips so)."""
    av = _av()
    with av.open(io.BytesIO(data), mode="r") as f:
        return [frame.to_image() for frame in f.decode(video=0)]


def first_frame(data: bytes):
    """The first frame of a stored clip as a PIL image (for clips stored without a poster)."""
    av = _av()
    with av.open(io.BytesIO(data), mode="r") as f:
        for frame in f.decode(video=0):
            return frame.to_image()
    raise ValueError("the clip has no frames")
