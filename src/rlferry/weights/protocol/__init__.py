"""The push protocol between a sender and its receivers: what travels, and what each
side knows of the other.

- ``_messages``: the control messages (tagged, frozen structs) on the sender's wire
  service, and the long-poll flow they follow;
- ``_datagrams``: the start line and the commit line, datagram sockets between the
  pushing thread and a receiver's thread that skip the wire loop;
- ``_members``: what a sender knows of each receiver and of the push in progress.
"""
