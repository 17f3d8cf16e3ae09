package zeroshard;

/**
 * A zeroshard call returned a status other than ZS_OK. Thrown by every
 * generated wrapper (zeroshard.i's out typemap on zs_status), with the
 * engine's message (zs_last_error() of the calling thread).
 */
public class ZeroShardException extends RuntimeException {
  private static final long serialVersionUID = 1L;
  private final int status;
  private final String statusName;
  private final String engineMessage;

  public ZeroShardException(int status, String statusName, String engineMessage) {
    super(statusName + ": " + engineMessage);
    this.status = status;
    this.statusName = statusName;
    this.engineMessage = engineMessage;
  }

  /** The zs_status value (ZsNative.ZS_ERR_...). */
  public int status() { return status; }

  /** zs_status_string(status), e.g. "ZS_ERR_INVALID_CONFIG". */
  public String statusName() { return statusName; }

  /** zs_last_error() right after the failed call. */
  public String engineMessage() { return engineMessage; }
}
