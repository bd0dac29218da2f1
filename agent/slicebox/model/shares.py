"""The ``[shares]`` table of the config: what one user may hold at once of what the agent
bounds for everyone (:mod:`slicebox.core.shares`).

    [shares]
    user_share = 0.5            # of each bound below and of exec_output_budget, per user
    streams_in_flight = 64      # streamed execs and runs answering at once, all users
    transfers_in_flight = 32    # file transfers (PUT/GET .../files) at once, all users
    pulls_in_flight = 8         # distinct image pulls at once, all users
"""

from pydantic import ConfigDict, Field

from slicebox.model.base import Model

DEFAULT_USER_SHARE = 0.5
DEFAULT_STREAMS_IN_FLIGHT = 64
DEFAULT_TRANSFERS_IN_FLIGHT = 32
# A slow pull holds the engine's download slots (three by default) for up to
# pull_timeout_seconds: one user's share (four) leaves the others pulls of their own.
DEFAULT_PULLS_IN_FLIGHT = 8


class SharesConfig(Model):
    model_config = ConfigDict(frozen=True, extra="forbid")

    user_share: float = Field(
        default=DEFAULT_USER_SHARE,
        gt=0,
        le=1,
        description="the most of each bound one user (root and slicebox-admin excepted) holds "
        "at once: of the exec output budget, of streams, transfers and pulls in flight; 1: no "
        "share",
    )
    streams_in_flight: int = Field(
        default=DEFAULT_STREAMS_IN_FLIGHT,
        gt=0,
        description="streamed execs and runs answering at once, all users",
    )
    transfers_in_flight: int = Field(
        default=DEFAULT_TRANSFERS_IN_FLIGHT,
        gt=0,
        description="file transfers at once, all users",
    )
    pulls_in_flight: int = Field(
        default=DEFAULT_PULLS_IN_FLIGHT,
        gt=0,
        description="distinct image pulls at once, all users (creates of an image being "
        "pulled wait for that pull and take none)",
    )

    def share_of(self, total: int) -> int:
        """One user's share of ``total`` things (streams, transfers): at least one."""
        return max(1, int(total * self.user_share))
